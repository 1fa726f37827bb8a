"""Engine-facing tensors over a flat byte backing, built zero-copy with ``as_strided``.

:func:`layer_views` describes each layer's view (shape, stride, storage offset, dtype) as
data; :func:`build_layer_views` materialises them over a backing tensor. The remaining
helpers cut a view into K and V, scales, or NVFP4 data and scales — always as views of the
same bytes, never copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastickv.geometry.content import SCALE_BYTES, KVQuant
from elastickv.geometry.errors import GeometryError
from elastickv.geometry.layout import AXIS_B, AXIS_H, AXIS_N
from elastickv.geometry.spec import AttentionKind, Contract, KVCacheGeometry


@dataclass(frozen=True)
class LayerView:
    """One layer's view: ``torch.as_strided(backing.view(dtype), shape, stride, offset)``.

    ``stride`` and ``storage_offset`` are in elements of ``dtype``, counted from the start
    of the backing.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype

    def as_dict(self) -> dict[str, object]:
        return {
            "shape": list(self.shape),
            "stride": list(self.stride),
            "storage_offset": self.storage_offset,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def layer_views(geometry: KVCacheGeometry) -> list[LayerView]:
    """Every layer's engine-facing view, in the shape the geometry's contract defines."""
    return [layer_view(geometry, layer) for layer in range(geometry.num_layers)]


def layer_view(geometry: KVCacheGeometry, layer: int) -> LayerView:
    esize = geometry.row.element_size
    _, blocks, heads, tokens, content = geometry.view_shape
    strides = [s // esize for s in geometry.view_strides]
    offset = geometry.layer_offset(layer) // esize
    sb, sh, sn = strides[AXIS_B], strides[AXIS_H], strides[AXIS_N]
    width = content // esize
    kind = geometry.kind
    dtype = geometry.storage_dtype
    if kind is AttentionKind.MLA and geometry.contract is Contract.V028:
        return LayerView((blocks, tokens, width), (sb, sn, 1), offset, dtype)
    if kind in (AttentionKind.SPLIT_KV, AttentionKind.SPLIT_KV_BLOCK_FIRST):
        heads_kv, head = geometry.num_kv_heads, geometry.head_size
        inner = (tokens, heads_kv, head), (sn, head, 1)
        if kind is AttentionKind.SPLIT_KV:
            return LayerView((2, blocks, *inner[0]), (sh, sb, *inner[1]), offset, dtype)
        return LayerView((blocks, 2, *inner[0]), (sb, sh, *inner[1]), offset, dtype)
    return LayerView((blocks, heads, tokens, width), (sb, sh, sn, 1), offset, dtype)


def build_layer_views(geometry: KVCacheGeometry, backing: torch.Tensor) -> list[torch.Tensor]:
    """Views of every layer over ``backing`` (a flat 1-byte tensor), zero copy.

    Like vLLM, each view is cut in bytes and then reinterpreted as the storage dtype, so
    shapes, strides and offsets come out exactly as vLLM's own.
    """
    check_backing(geometry, backing)
    return [_materialise(backing, v) for v in layer_views(geometry)]


def _materialise(backing: torch.Tensor, view: LayerView) -> torch.Tensor:
    esize = torch.empty((), dtype=view.dtype).element_size()
    shape = (*view.shape[:-1], view.shape[-1] * esize)
    stride = (*(s * esize for s in view.stride[:-1]), 1)
    raw = torch.as_strided(
        backing, shape, stride, backing.storage_offset() + view.storage_offset * esize
    )
    return raw.view(view.dtype)


def check_backing(geometry: KVCacheGeometry, backing: torch.Tensor) -> None:
    """Fail before building views that would read outside ``backing``."""
    if backing.dim() != 1 or backing.element_size() != 1:
        raise GeometryError(
            "backing", f"must be a flat 1-byte tensor, got {backing.dtype} {tuple(backing.shape)}"
        )
    if backing.stride(0) != 1:
        # as_strided ignores the backing's stride: views would cover bytes it skips.
        raise GeometryError("backing", f"must be contiguous, got stride {backing.stride(0)}")
    if backing.numel() < geometry.backing_bytes:
        raise GeometryError(
            "backing",
            f"holds {backing.numel()} bytes; the geometry needs {geometry.backing_bytes}",
        )
    # Per-token-head rows carry fp32 scales: their views need 4-byte aligned bytes.
    align = SCALE_BYTES if geometry.quant.is_per_token_head else geometry.row.element_size
    if backing.storage_offset() % align:
        raise GeometryError("backing", f"storage offset is not {align}-byte aligned")


def split_kv(geometry: KVCacheGeometry, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's view, zero copy.

    Packed rows follow vLLM's ``view.transpose(1, 2).split(head_size, -1)``: each side is
    ``(B, N, H, D)``; per-token-head modes return the data only (see :func:`scale_views`).
    NVFP4 returns the K and V head slots ``view[:, :H]``/``view[:, H:]`` as ``(B, H, N, W)``
    (cut further with :func:`nvfp4_data_scale`). Legacy split K/V returns its two planes.
    """
    kind, row = geometry.kind, geometry.row
    esize = row.element_size
    if kind is AttentionKind.MLA:
        raise GeometryError("kind", "an MLA latent cache has no K/V split")
    if kind is AttentionKind.SPLIT_KV:
        return view[0], view[1]
    if kind is AttentionKind.SPLIT_KV_BLOCK_FIRST:
        return view[:, 0], view[:, 1]
    if geometry.quant is KVQuant.NVFP4:
        heads = geometry.num_kv_heads
        return view[:, :heads], view[:, heads:]
    rows = view.transpose(1, 2)
    k = rows[..., row.k_offset // esize : (row.k_offset + row.k_bytes) // esize]
    v = rows[..., row.v_offset // esize : (row.v_offset + row.v_bytes) // esize]
    return k, v


def scale_views(geometry: KVCacheGeometry, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 per-token-head scales of K and V, each ``(B, H, N)``, zero copy."""
    row = geometry.row
    if row.k_scale_offset is None or row.v_scale_offset is None:
        raise GeometryError(
            "kv_cache_dtype",
            f"{geometry.quant.value} has no per-token-head scales",
            [q.value for q in KVQuant if q.is_per_token_head],
        )
    blocks, heads, tokens, _ = view.shape
    s0, s1, s2, _ = view.stride()
    return tuple(  # type: ignore[return-value]
        torch.as_strided(
            view, (blocks, heads, tokens, SCALE_BYTES), (s0, s1, s2, 1), view.storage_offset() + off
        ).view(torch.float32)[..., 0]
        for off in (row.k_scale_offset, row.v_scale_offset)
    )


def nvfp4_data_scale(side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut one NVFP4 side ``(B, H, N, W)`` into fp4 data and fp8 scales, zero copy.

    Inside a block the side holds all its data (``H·N·W·8/9`` bytes), then all its scales;
    the inner strides keep the side's physical order.
    """
    blocks, heads, tokens, full = side.shape
    data_w = full * 8 // 9
    scale_w = full - data_w
    s0, s1, s2, _ = side.stride()
    base = side.storage_offset()
    data = torch.as_strided(
        side,
        (blocks, heads, tokens, data_w),
        (s0, s1 * data_w // full, s2 * data_w // full, 1),
        base,
    )
    scale = torch.as_strided(
        side,
        (blocks, heads, tokens, scale_w),
        (s0, s1 * scale_w // full, s2 * scale_w // full, 1),
        base + heads * tokens * data_w,
    )
    return data, scale
