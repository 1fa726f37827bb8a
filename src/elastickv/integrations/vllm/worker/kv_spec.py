"""A layer's KV cache spec in vLLM's ``KVCacheConfig``: read the same way in every supported
vLLM version, and refused unless it is a kind elastickv places."""

from __future__ import annotations

from typing import Any

from elastickv.integrations.vllm.errors import ElasticKVStartupError

SUPPORTED_SPECS = ("FullAttentionSpec",)


def layer_spec(kv_cache_config: Any, layer_name: str) -> Any:
    """The spec of ``layer_name`` (its group's, or its own in a per-layer spec)."""
    for group in kv_cache_config.kv_cache_groups:
        if layer_name in group.layer_names:
            spec = group.kv_cache_spec
            per_layer = getattr(spec, "kv_cache_specs", None)
            return per_layer[layer_name] if per_layer is not None else spec
    raise ElasticKVStartupError(f"layer {layer_name!r} is in no KV cache group")


def full_attention_spec(kv_cache_config: Any, layer_name: str) -> Any:
    """The spec of ``layer_name``, or a start-up error when it is not full attention without
    a sliding window (the only kind whose blocks elastickv lays out)."""
    spec = layer_spec(kv_cache_config, layer_name)
    kind = type(spec).__name__
    window = getattr(spec, "sliding_window", None)
    if kind not in SUPPORTED_SPECS or window is not None:
        raise ElasticKVStartupError(
            f"elastickv does not support the {kind} KV cache spec (sliding window {window}); "
            f"supported: {', '.join(SUPPORTED_SPECS)} without sliding window"
        )
    return spec
