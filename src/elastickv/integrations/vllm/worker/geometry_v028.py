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
from elastickv.integrations.vllm.worker.kv_spec import full_attention_spec

# Backends whose 0.28 shape is the packed ``(B, H, N, 2D)`` row format, as tested end to end.
SUPPORTED_BACKENDS = ("CPU_ATTN",)


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


def stride_order(backend: Any) -> tuple[int, ...]:
    """vLLM 0.28's rule: the backend's per-layer stride order, identity if it has none."""
    try:
        order = tuple(int(i) for i in backend.get_kv_cache_stride_order())
    except (AttributeError, NotImplementedError):
        order = (0, 1, 2, 3)
    return order


def plan_from_config(
    kv_cache_config: Any, backend: Any, kernel_block_size: int | None
) -> PerLayerPlan:
    """The geometry of vLLM 0.28's per-layer KV cache, or a start-up error naming why not."""
    layers, layer_bytes = per_layer_tensors(kv_cache_config)
    name = str(backend.get_name())
    if name not in SUPPORTED_BACKENDS:
        raise ElasticKVStartupError(
            f"elastickv does not support the {name} attention backend with vLLM 0.28; "
            f"supported: {', '.join(SUPPORTED_BACKENDS)}"
        )
    spec = full_attention_spec(kv_cache_config, layers[0])
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    slots = getattr(spec, "num_head_slots", None)
    if quant != "NONE" or slots not in (None, spec.num_kv_heads):
        raise ElasticKVStartupError(
            f"elastickv does not support KV quantization mode {quant} / {slots} head slots "
            "with vLLM 0.28 yet (set by --kv-cache-dtype); supported: NONE with one slot per "
            "KV head (--kv-cache-dtype auto)"
        )
    page = int(spec.page_size_bytes)
    if layer_bytes % page:
        raise ElasticKVStartupError(
            f"vLLM's per-layer KV tensor ({layer_bytes} B) is not a whole number of "
            f"{page}-byte pages"
        )
    num_blocks = layer_bytes // page
    kbs = int(kernel_block_size) if kernel_block_size is not None else int(spec.block_size)
    shape = tuple(backend.get_kv_cache_shape(num_blocks, kbs, spec.num_kv_heads, spec.head_size))
    packed = (num_blocks, int(spec.num_kv_heads), kbs, 2 * int(spec.head_size))
    if shape != packed:
        raise ElasticKVStartupError(
            f"the {name} backend's KV cache shape {shape} is not the packed (B, H, N, 2D) "
            f"shape {packed} elastickv models for it"
        )
    try:
        geometry = KVCacheGeometry(
            num_layers=len(layers),
            num_blocks=num_blocks,
            num_kv_heads=int(spec.num_kv_heads),
            block_size=int(spec.block_size),
            head_size=int(spec.head_size),
            head_size_v=int(spec.head_size_v),
            dtype=str(spec.dtype).removeprefix("torch."),
            layout=layout_from_stride_order(stride_order(backend)),
            kind="packed",
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
