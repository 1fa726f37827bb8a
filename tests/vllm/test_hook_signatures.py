"""The scheduler hooks take their fast form on this vLLM: a forwarder with the hooked
method's own parameters (no ``*args, **kwargs`` packing on every call), and the prefix hits
found where vLLM passes them."""

from __future__ import annotations

import inspect

from elastickv.integrations.vllm.hooks import forward_positionally


def test_hooked_methods_get_positional_forwarders() -> None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    for method in (KVCacheCoordinator.get_num_blocks_to_allocate, KVCacheManager.allocate_slots):
        original = getattr(method, "__elastickv_original__", method)
        assert forward_positionally(original, lambda self, args: args) is not None, method
    names = list(inspect.signature(KVCacheCoordinator.get_num_blocks_to_allocate).parameters)
    assert names[:4] == ["self", "request_id", "num_tokens", "new_computed_blocks"]
    assert list(inspect.signature(KVCacheManager.allocate_slots).parameters)[1] == "request"
