"""vLLM 0.28's ``KVCacheConfig`` + attention backend → our :class:`KVCacheGeometry`.

Under the 0.28 contract vLLM allocates one ``torch.zeros(size, int8)`` per ``KVCacheTensor``
(one per layer) and views it as ``view(permuted shape).permute(inverse order)`` from the
backend's ``get_kv_cache_shape`` / ``get_kv_cache_stride_order``. elastickv places those
per-layer backings back to back in one elastic range (layer ``l`` at ``l × layer bytes``),
which is exactly the per-layer layout ``KVCacheGeometry(contract="0.28")`` describes. The
layout is taken from the backend's explicit stride order (identity when it has none), never
inferred from a shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastickv.geometry import Contract, GeometryError, KVCacheGeometry, layout_from_stride_order
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.worker.kv_spec import attention_spec, is_mla, row_dtypes

# Backends whose 0.28 KV caches elastickv places: the packed ``(B, H, N, Dk + Dv)`` shape in
# their stride order, or MLA's ``(B, N, D)`` per layer. Each is proven by the runner contract
# tests (vLLM's own allocation and views, over elastic storage, byte for byte equal to
# native), and is one vLLM's CPU or CUDA platform selects.
SUPPORTED_BACKENDS = (
    "CPU_ATTN",
    "FLASH_ATTN",
    "FLASH_ATTN_DIFFKV",
    "TRITON_ATTN",
    "TRITON_ATTN_DIFFKV",
    "FLEX_ATTENTION",
    "FLASHMLA",
    "TRITON_MLA",
    "TOKENSPEED_MLA",
)


@dataclass(frozen=True)
class PerLayerPlan:
    """Where each layer's backing goes: ``layers[l]`` at ``l * layer_bytes``."""

    geometry: KVCacheGeometry
    layers: tuple[str, ...]
    layer_bytes: int

    @property
    def size_bytes(self) -> int:
        return self.layer_bytes * len(self.layers)


def per_layer_tensors(kv_cache_config: Any) -> tuple[tuple[str, ...], int]:
    """Layer names in allocation order and the common size of their ``KVCacheTensor``."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    if not tensors:
        raise ElasticKVStartupError("vLLM's KV cache config has no KVCacheTensor")
    layers: list[str] = []
    sizes = set()
    for tensor in tensors:
        shared = list(tensor.shared_by)
        if len(shared) != 1 or int(getattr(tensor, "block_stride", 0)) or int(tensor.offset):
            raise ElasticKVStartupError(
                "elastickv supports vLLM 0.28 KV caches with one unpacked KVCacheTensor per "
                f"layer; this model has a tensor shared by {shared} (block stride "
                f"{getattr(tensor, 'block_stride', 0)}, offset {tensor.offset})"
            )
        layers.append(shared[0])
        sizes.add(int(tensor.size))
    if len(sizes) != 1:
        raise ElasticKVStartupError(
            f"elastickv needs equal per-layer KV tensors; vLLM sized them {sorted(sizes)}"
        )
    return tuple(layers), sizes.pop()


def backend_of(attn_groups: Any, layers: tuple[str, ...]) -> Any:
    """The one attention backend class every KV layer uses."""
    found: dict[str, Any] = {}
    for groups in attn_groups:
        for group in groups:
            for name in group.layer_names:
                found[name] = group.backend
    missing = [name for name in layers if name not in found]
    if missing:
        raise ElasticKVStartupError(f"layers {missing} have no attention backend")
    backends = {found[name] for name in layers}
    if len(backends) != 1:
        names = sorted(b.get_name() for b in backends)
        raise ElasticKVStartupError(
            f"elastickv supports one attention backend per engine; this one uses {names}"
        )
    return backends.pop()


def registered_name(backend: Any) -> str:
    """The ``AttentionBackendEnum`` name vLLM registers ``backend``'s class under (its own
    ``get_name()`` is not unique: ROCm's AITER FlashAttention answers ``FLASH_ATTN``); a
    class registered under no name is named by its path, which no allowlist holds."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    path = f"{backend.__module__}.{backend.__qualname__}"
    for member in AttentionBackendEnum:
        try:
            registered = member.get_path()
        except ValueError:  # a placeholder no class is registered under (TORCH_SDPA, CUSTOM)
            continue
        if registered == path:
            return str(member.name)
    return f"{backend.get_name()} ({path})"


def stride_order(backend: Any, dims: int) -> tuple[int, ...]:
    """vLLM 0.28's rule: the backend's per-layer stride order of its ``dims``-dimensional
    shape, identity if it has none (or one of another length)."""
    try:
        order = tuple(int(i) for i in backend.get_kv_cache_stride_order())
    except (AttributeError, NotImplementedError):
        order = tuple(range(dims))
    return order if len(order) == dims else tuple(range(dims))


def plan_from_config(
    kv_cache_config: Any, backend: Any, kernel_block_size: int | None
) -> PerLayerPlan:
    """The geometry of vLLM 0.28's per-layer KV cache, or a start-up error naming why not."""
    layers, layer_bytes = per_layer_tensors(kv_cache_config)
    name = registered_name(backend)
    if name not in SUPPORTED_BACKENDS:
        raise ElasticKVStartupError(
            f"elastickv does not support the {name} attention backend with vLLM 0.28; "
            f"supported: {', '.join(SUPPORTED_BACKENDS)}"
        )
    spec = attention_spec(kv_cache_config, layers[0])
    dtype, kv_cache_dtype = row_dtypes(spec, "0.28")
    mla = is_mla(spec)
    page = int(spec.page_size_bytes)
    if layer_bytes % page:
        raise ElasticKVStartupError(
            f"vLLM's per-layer KV tensor ({layer_bytes} B) is not a whole number of "
            f"{page}-byte pages"
        )
    num_blocks = layer_bytes // page
    kbs = int(kernel_block_size) if kernel_block_size is not None else int(spec.block_size)
    if kbs <= 0 or int(spec.block_size) % kbs:
        raise ElasticKVStartupError(
            f"kernel block size {kbs} does not divide the block size {spec.block_size}"
        )
    kernel_blocks = num_blocks * (int(spec.block_size) // kbs)
    heads, head_size = int(spec.num_kv_heads), int(spec.head_size)
    shape = tuple(
        backend.get_kv_cache_shape(
            kernel_blocks,
            kbs,
            heads,
            head_size,
            cache_dtype_str=getattr(spec, "cache_dtype_str", None) or kv_cache_dtype,
        )
    )
    modelled: tuple[int, ...]
    if mla:
        modelled = (kernel_blocks, kbs, head_size)
        what = "MLA (B, N, D)"
    else:
        modelled = (kernel_blocks, heads, kbs, head_size + int(spec.head_size_v))
        what = "packed (B, H, N, Dk + Dv)"
    if shape != modelled:
        raise ElasticKVStartupError(
            f"the {name} backend's KV cache shape {shape} is not the {what} shape {modelled} "
            "elastickv models for it"
        )
    order = stride_order(backend, len(shape))
    if mla and order != (0, 1, 2):
        raise ElasticKVStartupError(
            f"the {name} backend orders its MLA cache {order}; elastickv places MLA caches "
            "in their own order (0, 1, 2) per layer"
        )
    try:
        geometry = KVCacheGeometry(
            num_layers=len(layers),
            num_blocks=num_blocks,
            num_kv_heads=heads,
            block_size=int(spec.block_size),
            head_size=head_size,
            head_size_v=None if mla else int(spec.head_size_v),
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            layout="LBHNC" if mla else layout_from_stride_order(order),
            kind="mla" if mla else "packed",
            kernel_block_size=kbs,
            page_size_padded=spec.page_size_padded,
            contract=Contract.V028,
        )
    except GeometryError as exc:
        raise ElasticKVStartupError(f"elastickv rejects vLLM's KV cache geometry: {exc}") from exc
    if geometry.layer_stride_bytes != layer_bytes or geometry.backing_bytes > layer_bytes * len(
        layers
    ):
        raise ElasticKVStartupError(
            f"elastickv's 0.28 geometry puts layers {geometry.layer_stride_bytes} B apart but "
            f"vLLM's per-layer tensors are {layer_bytes} B; refusing to guess the layout"
        )
    return PerLayerPlan(geometry, layers, layer_bytes)
