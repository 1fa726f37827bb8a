"""vLLM 0.32's ``KVCacheConfig`` → our :class:`KVCacheGeometry`.

vLLM builds its per-layer views itself; we derive the same views independently from the
published strides and layout name, and the worker refuses to run if the two disagree
(:func:`~elastickv.integrations.vllm.worker.worker.verify_views`: a disagreement means our page
accounting would commit the wrong bytes).
"""

from __future__ import annotations

from typing import Any

from elastickv.geometry import Contract, GeometryError, KVCacheGeometry
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.worker.kv_spec import attention_spec, is_mla, row_dtypes


def single_tensor(kv_cache_config: Any) -> Any:
    """The one ``KVCacheTensor`` elastickv places (several → not supported yet)."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    if len(tensors) != 1:
        raise ElasticKVStartupError(
            f"elastickv supports models whose KV cache is one KVCacheTensor (one attention "
            f"type); this model has {len(tensors)}"
        )
    return tensors[0]


def geometry_from_config(
    kv_cache_config: Any, layout_name: str, kernel_block_size: int | None
) -> KVCacheGeometry:
    """The geometry of vLLM's KV cache, or a start-up error naming what is unsupported."""
    tensor = single_tensor(kv_cache_config)
    spec = attention_spec(kv_cache_config, tensor.layers[0])
    dtype, kv_cache_dtype = row_dtypes(spec, "0.32")
    mla = is_mla(spec)
    try:
        geometry = KVCacheGeometry(
            num_layers=len(tensor.layers),
            num_blocks=int(kv_cache_config.num_blocks_of(tensor)),
            num_kv_heads=int(spec.num_kv_heads),
            block_size=int(spec.block_size),
            head_size=int(spec.head_size),
            head_size_v=None if mla else int(spec.head_size_v),
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            layout=layout_name,
            kind="mla" if mla else "packed",
            kernel_block_size=kernel_block_size,
            page_size_padded=spec.page_size_padded,
            offset=int(tensor.offset),
            layer_stride=int(tensor.layer_stride),
            block_stride=int(tensor.block_stride),
            contract=Contract.V032,
        )
    except GeometryError as exc:
        raise ElasticKVStartupError(f"elastickv rejects vLLM's KV cache geometry: {exc}") from exc
    if geometry.backing_bytes > int(tensor.size):
        raise ElasticKVStartupError(
            f"vLLM's KV cache tensor holds {tensor.size} bytes but its strides reach "
            f"{geometry.backing_bytes}; refusing to guess the layout"
        )
    return geometry
