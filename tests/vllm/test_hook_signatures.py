"""The scheduler hooks take their fast form on this vLLM: compiled with the hooked method's
own parameters (no ``*args, **kwargs`` packing on every call), reading the request and the
prefix hits where vLLM passes them."""

from __future__ import annotations

from elastickv.integrations.vllm.hooks import compile_hook


def test_hooked_methods_get_compiled_hooks() -> None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    from elastickv.integrations.vllm import scheduler_hooks
    from elastickv.integrations.vllm.block_pool import ElasticBlockPool

    names = {
        "ElasticBlockPool": ElasticBlockPool,
        "running_status": object(),
        "elastic_pool": scheduler_hooks._elastic_pool,
    }
    for method, template, uses in (
        (
            KVCacheCoordinator.get_num_blocks_to_allocate,
            scheduler_hooks.EXPECT_HOOK,
            ("self", "new_computed_blocks"),
        ),
        (KVCacheManager.allocate_slots, scheduler_hooks.WINDOW_HOOK, ("self", "request")),
        (Scheduler.schedule, scheduler_hooks.SCHEDULE_HOOK, ("self",)),
        (Scheduler.update_from_output, scheduler_hooks.UPDATE_HOOK, ("self",)),
    ):
        original = getattr(method, "__elastickv_original__", method)
        assert compile_hook(original, template, names, uses) is not None, method
