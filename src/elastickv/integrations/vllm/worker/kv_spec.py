"""A layer's KV cache spec in vLLM's ``KVCacheConfig``: read the same way in every supported
vLLM version, and refused unless its rows are ones elastickv's geometry lays out.

Placeable: full attention (K and V packed in one row per head and token) and MLA (one latent
row per token), unquantized or per-tensor fp8 (one byte per value, scales outside the
pages). Refused by name, before any memory is touched: sliding windows and other spec kinds,
K and V stored as separate head planes (``num_head_slots``: ROCm's and B12X's two-plane
layout), opaque rows of a backend's own size (``state_content_bytes``: ``fp8_ds_mla``,
TurboQuant), states holding several tokens, and every other quantization mode.
"""

from __future__ import annotations

from typing import Any

from elastickv.integrations.vllm.errors import ElasticKVStartupError

SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
# vLLM's KVQuantMode name -> the geometry's kv_cache_dtype.
SUPPORTED_QUANT = {"NONE": "auto", "FP8_PER_TENSOR": "fp8"}
# The --kv-cache-dtype values these modes come from (vLLM: "fp8*" is per-tensor fp8).
SUPPORTED_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
# The geometry needs a model dtype; a quantized row's element is one byte whatever it is.
_QUANTIZED_ROW_MODEL_DTYPE = "bfloat16"


def layer_spec(kv_cache_config: Any, layer_name: str) -> Any:
    """The spec of ``layer_name`` (its group's, or its own in a per-layer spec)."""
    for group in kv_cache_config.kv_cache_groups:
        if layer_name in group.layer_names:
            spec = group.kv_cache_spec
            per_layer = getattr(spec, "kv_cache_specs", None)
            return per_layer[layer_name] if per_layer is not None else spec
    raise ElasticKVStartupError(f"layer {layer_name!r} is in no KV cache group")


def attention_spec(kv_cache_config: Any, layer_name: str) -> Any:
    """The spec of ``layer_name``, or a start-up error when it is not full attention or MLA
    without a sliding window (the kinds whose blocks elastickv lays out)."""
    spec = layer_spec(kv_cache_config, layer_name)
    kind = type(spec).__name__
    window = getattr(spec, "sliding_window", None)
    if kind not in SUPPORTED_SPECS or window is not None:
        raise ElasticKVStartupError(
            f"elastickv does not support the {kind} KV cache spec (sliding window {window}); "
            f"supported: {', '.join(SUPPORTED_SPECS)} without sliding window"
        )
    return spec


def is_mla(spec: Any) -> bool:
    return type(spec).__name__ == "MLAAttentionSpec"


def row_dtypes(spec: Any, contract: str) -> tuple[str, str]:
    """The geometry's ``(dtype, kv_cache_dtype)`` for ``spec``'s rows, or a start-up error
    naming the row format elastickv does not lay out."""
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    cache_dtype = str(getattr(spec, "cache_dtype_str", None) or "auto")
    if quant not in SUPPORTED_QUANT or cache_dtype not in SUPPORTED_CACHE_DTYPES:
        shown = quant if cache_dtype == "auto" else f"{quant} ({cache_dtype})"
        raise ElasticKVStartupError(
            f"elastickv does not support KV quantization mode {shown} with vLLM {contract} "
            f"(set by --kv-cache-dtype); supported: --kv-cache-dtype "
            f"{' / '.join(SUPPORTED_CACHE_DTYPES)}"
        )
    slots = getattr(spec, "num_head_slots", None)
    if slots is not None:
        raise ElasticKVStartupError(
            f"elastickv does not support a KV cache stored as {slots} head slots of the "
            f"backend's own rows for {spec.num_kv_heads} KV heads (K and V as separate planes, "
            "as ROCm's and B12X's backends store them); supported: K and V packed in one row "
            "per head (FLASH_ATTN, TRITON_ATTN, ...)"
        )
    content = getattr(spec, "state_content_bytes", None)
    if content is not None:
        raise ElasticKVStartupError(
            f"elastickv does not support KV rows of {content} bytes in a backend's own "
            "format (such as fp8_ds_mla or TurboQuant); supported: rows of K and V (or an "
            "MLA latent) in the model dtype or fp8"
        )
    tokens = int(getattr(spec, "tokens_per_state", 1))
    stored = int(getattr(spec, "storage_block_size", spec.block_size))
    if tokens != 1 or stored != int(spec.block_size):
        raise ElasticKVStartupError(
            f"elastickv does not support a compressed KV cache ({tokens} tokens per state, "
            f"{stored} states per block of {spec.block_size} tokens); supported: one row "
            "per token"
        )
    if quant != "NONE":
        return _QUANTIZED_ROW_MODEL_DTYPE, SUPPORTED_QUANT[quant]
    return str(spec.dtype).removeprefix("torch."), "auto"
