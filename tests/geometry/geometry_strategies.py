"""Hypothesis strategies and byte-level helpers for the geometry tests.

:func:`geometries` draws valid :class:`KVCacheGeometry` values over every layout, attention
kind, ``kv_cache_dtype`` and both vLLM contracts. It is valid by construction: each choice
is drawn from what the earlier choices allow, so the constructor never rejects a draw (a
rejection is a bug in the geometry or in this module, and surfaces as an error).

The helpers turn engine-facing tensors back into the set of backing bytes they cover, so
properties can be stated about bytes rather than about the strides that produce them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from hypothesis import strategies as st

from elastickv.geometry import (
    KV_CACHE_DTYPES,
    LAYOUT_NAMES,
    AttentionKind,
    ByteRange,
    KVCacheGeometry,
    KVLayout,
    KVQuant,
)

MODEL_DTYPE_NAMES = ("float16", "half", "bfloat16", "float32", "float")
PACKED, MLA = AttentionKind.PACKED.value, AttentionKind.MLA.value
SPLIT_KV, SPLIT_KV_BLOCK_FIRST = (
    AttentionKind.SPLIT_KV.value,
    AttentionKind.SPLIT_KV_BLOCK_FIRST.value,
)
KINDS = (PACKED, MLA, SPLIT_KV, SPLIT_KV_BLOCK_FIRST)
CONTRACTS = ("0.28", "0.32")
PER_LAYER_NAMES = ("LBHNC", "LBNHC", "NHD", "HND")
# What vLLM 0.28's stride orders produce for the packed shape (per layer and cross layer).
V028_PACKED_NAMES = (*PER_LAYER_NAMES, "BHLNC", "BLNHC")
# NVFP4 needs each side's [H, N, C] contiguous: HND inside the page.
NVFP4_NAMES = ("LBHNC", "HND", "BLHNC")
# Legacy split K/V: NHD per layer; (B, 2, N, H, D) also cross layer as HPC_ATTN builds it.
SPLIT_LAYOUT_NAMES = {SPLIT_KV: ("NHD", "LHBNC"), SPLIT_KV_BLOCK_FIRST: ("NHD", "LBHNC", "BLHNC")}
# vLLM 0.28 MLA: per layer, or block-outermost cross layer (FlashMLA's layered order).
V028_MLA_NAMES = (*PER_LAYER_NAMES, "BLHNC", "BLNHC")


def _layout_names(contract: str, kind: str, kv_cache_dtype: str) -> tuple[str, ...]:
    quant = KVQuant.parse(kv_cache_dtype)
    if kind in SPLIT_LAYOUT_NAMES:
        return SPLIT_LAYOUT_NAMES[kind]
    if kind == MLA:
        return V028_MLA_NAMES if contract == "0.28" else LAYOUT_NAMES
    names = V028_PACKED_NAMES if contract == "0.28" else LAYOUT_NAMES
    if quant is KVQuant.NVFP4:
        names = tuple(n for n in names if n in NVFP4_NAMES)
    return names


def _dtypes_for(kind: str) -> tuple[str, ...]:
    if kind == PACKED:
        return KV_CACHE_DTYPES
    return tuple(d for d in KV_CACHE_DTYPES if KVQuant.parse(d) in (KVQuant.NONE, KVQuant.FP8))


def _all_combos() -> list[tuple[str, str, str, str]]:
    """Every (contract, kind, kv_cache_dtype, layout name) the geometry accepts."""
    combos = []
    for contract in CONTRACTS:
        for kind in KINDS:
            if contract == "0.32" and kind in SPLIT_LAYOUT_NAMES:
                continue
            for dtype in _dtypes_for(kind):
                for layout in _layout_names(contract, kind, dtype):
                    combos.append((contract, kind, dtype, layout))
    return combos


COMBOS = _all_combos()


def _pick(draw: st.DrawFn, combos: list[tuple[str, ...]], position: int) -> list[tuple[str, ...]]:
    """Draw one value of ``position`` among the combos left, uniformly over values."""
    value = draw(st.sampled_from(sorted({c[position] for c in combos})))
    return [c for c in combos if c[position] == value]


def _head_sizes(draw: st.DrawFn, kind: str, quant: KVQuant) -> tuple[int, int | None]:
    """``(head_size, head_size_v)`` the row format accepts for this kind and quant mode."""
    if kind == MLA:
        return draw(st.integers(1, 24)), draw(st.sampled_from([None, 0]))
    if kind in SPLIT_LAYOUT_NAMES:
        size = draw(st.integers(1, 12))
        return size, draw(st.sampled_from([None, size]))
    if quant is KVQuant.NVFP4:
        size = 16 * draw(st.integers(1, 3))
        return size, draw(st.sampled_from([None, size]))
    if quant.is_per_token_head:
        # fp32 scales need 4-byte aligned data per side; int4 stores D/2 bytes.
        unit = 8 if quant is KVQuant.INT4_PER_TOKEN_HEAD else 4
        return unit * draw(st.integers(1, 4)), unit * draw(st.integers(1, 4))
    # Plain rows: any sizes, K and V may differ.
    return draw(st.integers(1, 12)), draw(st.one_of(st.none(), st.integers(1, 12)))


def _resolve(kind: str, layout_name: str) -> KVLayout:
    """The layout a name means for ``kind`` (legacy split K/V has one fixed layout each)."""
    if kind == SPLIT_KV:
        return KVLayout.LHBNC
    if kind == SPLIT_KV_BLOCK_FIRST and layout_name != "BLHNC":
        return KVLayout.LBHNC
    return KVLayout.parse(layout_name)


def _can_pad(contract: str, kind: str, kv_cache_dtype: str, layout_name: str) -> bool:
    """Whether some head count lets this combination pad its pages."""
    layout = _resolve(kind, layout_name)
    if contract == "0.28" and not layout.is_layer_outermost:
        return False  # 0.28 pads per-layer storage only
    # Head slots outside the page forbid padding unless there is one slot.
    return (
        layout.is_page_compact
        or kind == MLA
        or (kind == PACKED and KVQuant.parse(kv_cache_dtype) is not KVQuant.NVFP4)
    )


def _build(**params: object) -> KVCacheGeometry:
    try:
        return KVCacheGeometry(**params)  # type: ignore[arg-type]
    except Exception as exc:
        raise AssertionError(f"the strategy drew a rejected geometry {params}: {exc}") from exc


def _is_dense(geometry: KVCacheGeometry) -> bool:
    """Whether vLLM 0.32 may cut a logical block of this (unsplit) geometry into kernel blocks.

    The block of one layer must be one dense page: block stride == page, and no head slots
    outside the layer axis (the kernel walk keeps the layer stride, which would space them).
    """
    layout = geometry.layout
    assert isinstance(layout, KVLayout)
    heads_inside = layout.order.index(2) > layout.order.index(0)
    return geometry.block_stride_bytes == geometry.page_bytes and (
        heads_inside or geometry.num_head_slots == 1
    )


@st.composite
def geometries(
    draw: st.DrawFn,
    *,
    contracts: Sequence[str] = CONTRACTS,
    kinds: Sequence[str] = KINDS,
    kv_cache_dtypes: Sequence[str] | None = None,
    kernel_split: bool | None = None,
    padded: bool | None = None,
    overrides: bool | None = None,
) -> KVCacheGeometry:
    """A valid geometry; the keyword filters narrow the space (``None``: draw freely).

    ``kernel_split=True`` forces ``block_size // kernel_block_size`` in {2, 4};
    ``padded``/``overrides`` force page padding / 0.32 stride overrides on or off.
    """
    combos: list[tuple[str, ...]] = [
        c
        for c in COMBOS
        if c[0] in contracts
        and c[1] in kinds
        and (kv_cache_dtypes is None or c[2] in kv_cache_dtypes)
        and not (overrides and c[0] == "0.28")
    ]
    if padded:
        combos = [c for c in combos if _can_pad(*c)]
    assert combos, "no geometry matches the requested filters"
    for position in range(4):
        combos = _pick(draw, combos, position)
    contract, kind, kv_cache_dtype, layout_name = combos[0]
    layout = _resolve(kind, layout_name)
    quant = KVQuant.parse(kv_cache_dtype)

    num_layers = draw(st.integers(1, 4))
    num_kv_heads = draw(st.integers(1, 4))
    if kernel_split and contract == "0.32":
        # Kernel blocks need a dense page: force the axes that would interleave to size 1.
        if layout.is_block_outermost:
            num_layers = 1
        if (not layout.is_page_compact or layout is KVLayout.BHLNC) and kind == PACKED:
            num_kv_heads = 1
    if padded and not layout.is_page_compact and kind == PACKED:
        num_kv_heads = 1  # head slots outside the page: only one may be padded
    head_size, head_size_v = _head_sizes(draw, kind, quant)
    base: dict[str, object] = {
        "num_layers": num_layers,
        "num_blocks": draw(st.integers(1, 6)),
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "head_size_v": head_size_v,
        "dtype": draw(st.sampled_from(MODEL_DTYPE_NAMES)),
        "kv_cache_dtype": kv_cache_dtype,
        "layout": layout_name,
        "kind": kind,
        "contract": contract,
    }
    kernel_block_size = draw(st.integers(1, 4))
    ratios = [1] if padded else [2, 4] if kernel_split else [1, 2, 4]
    ratio = draw(st.sampled_from(ratios))
    whole = _build(**base, block_size=kernel_block_size * ratio)
    if contract == "0.32" and ratio > 1 and not _is_dense(whole):
        assert not kernel_split, f"{layout_name} left with an interleaved page"
        ratio = 1
    block_size = kernel_block_size * ratio
    base["block_size"] = block_size
    if ratio > 1 or draw(st.booleans()):
        base["kernel_block_size"] = block_size // ratio
    geometry = _build(**base)
    align = 4 if quant.is_per_token_head else geometry.row.element_size

    can_pad = ratio == 1 and (layout.is_page_compact or geometry.num_head_slots == 1)
    if contract == "0.28":
        can_pad = can_pad and layout.is_layer_outermost
    assert can_pad or not padded, f"{layout_name} cannot be padded"
    if can_pad and (padded or (padded is None and draw(st.booleans()))):
        base["page_size_padded"] = geometry.page_bytes + align * draw(st.integers(0, 6))
    base["offset"] = align * draw(st.integers(0, 4))
    geometry = _build(**base)

    if contract == "0.32" and (overrides or (overrides is None and draw(st.booleans()))):
        geometry = _with_overrides(draw, geometry, base, align, ratio)
    return geometry


def _with_overrides(
    draw: st.DrawFn,
    geometry: KVCacheGeometry,
    base: dict[str, object],
    align: int,
    ratio: int,
) -> KVCacheGeometry:
    """``KVCacheTensor``-style ``layer_stride``/``block_stride`` that keep views disjoint.

    Strides only grow (the inner of L and B first, the outer one past the grown inner
    one), or, for page-compact layouts, L and B swap roles (per-layer <-> cross-layer).
    """
    layout = geometry.layout
    assert isinstance(layout, KVLayout)
    order = layout.order
    inner, outer = (
        ("block_stride", "layer_stride")
        if order.index(1) > order.index(0)
        else ("layer_stride", "block_stride")
    )
    stride_of = {"layer_stride": "layer_stride_bytes", "block_stride": "block_stride_bytes"}

    def grow(g: KVCacheGeometry, name: str) -> int:
        current: int = getattr(g, stride_of[name])
        return current * draw(st.integers(1, 2)) + align * draw(st.integers(0, 3))

    modes = ["layer"] if ratio > 1 else ["layer", "block", "both", "swap"]
    if ratio > 1 and not layout.is_layer_outermost:
        return geometry  # only a block-outermost layout with one layer splits; L is free
    if not layout.is_page_compact:
        modes = [m for m in modes if m != "swap"]
    mode = draw(st.sampled_from(modes))
    params = dict(base)
    if mode == "swap":
        page = geometry.padded_page_bytes
        count = geometry.num_blocks if inner == "layer_stride" else geometry.num_layers
        # The outer of L/B becomes the inner one: one page apart, the other spans them all.
        params[outer] = page
        params[inner] = page * count * draw(st.integers(1, 2)) + align * draw(st.integers(0, 3))
        return _build(**params)
    if mode in ("block", "both"):
        name = "block_stride" if mode == "block" else inner
        params[name] = grow(geometry, name)
        geometry = _build(**params)
    if mode in ("layer", "both"):
        name = "layer_stride" if mode == "layer" else outer
        params[name] = grow(geometry, name)
    return _build(**params)


def unsplit(geometry: KVCacheGeometry) -> KVCacheGeometry:
    """The same geometry with kernel blocks equal to logical blocks."""
    return dataclasses.replace(geometry, kernel_block_size=geometry.block_size)


# ---------------------------------------------------------------------- byte helpers


def fresh_backing(geometry: KVCacheGeometry, lead: int = 0) -> torch.Tensor:
    """A zeroed flat uint8 backing of exactly ``backing_bytes``, ``lead`` bytes into its storage."""
    storage = torch.zeros(lead + geometry.backing_bytes, dtype=torch.uint8)
    return storage[lead:]


def byte_addresses(view: torch.Tensor, backing: torch.Tensor) -> torch.Tensor:
    """Every backing byte ``view``'s elements cover (int64, relative to ``backing[0]``).

    Element ``i`` of the view covers ``element_size`` bytes from its storage address; the
    addresses come from the view's own shape/stride/storage offset, read off the tensor.
    """
    assert view.untyped_storage().data_ptr() == backing.untyped_storage().data_ptr(), "a copy"
    esize = view.element_size()
    elements = view.untyped_storage().nbytes() // esize
    index = torch.arange(elements, dtype=torch.int64)
    starts = torch.as_strided(index, view.shape, view.stride(), view.storage_offset())
    first = starts.reshape(-1) * esize - int(backing.storage_offset())
    return (first[:, None] + torch.arange(esize)).reshape(-1)


def byte_mask(addresses: Iterable[torch.Tensor], size: int) -> torch.Tensor:
    """Bool mask of the union of ``addresses`` over ``size`` bytes."""
    mask = torch.zeros(size, dtype=torch.bool)
    for part in addresses:
        mask[part] = True
    return mask


def byte_counts(addresses: Iterable[torch.Tensor], size: int) -> torch.Tensor:
    """How many times each of ``size`` bytes is covered by ``addresses``."""
    counts = torch.zeros(size, dtype=torch.int64)
    for part in addresses:
        counts += torch.bincount(part, minlength=size)
    return counts


def ranges_mask(ranges: Iterable[ByteRange], size: int) -> torch.Tensor:
    mask = torch.zeros(size, dtype=torch.bool)
    for start, end in ranges:
        mask[start:end] = True
    return mask


def kernel_block_axis(geometry: KVCacheGeometry) -> int:
    """Which axis of a layer view indexes kernel blocks."""
    return 1 if geometry.kind is AttentionKind.SPLIT_KV else 0


def kernel_blocks_of(
    geometry: KVCacheGeometry, view: torch.Tensor, block: int
) -> list[torch.Tensor]:
    """The ``ratio`` kernel-block slices of logical ``block`` in one layer view."""
    axis = kernel_block_axis(geometry)
    ratio = geometry.kernel_ratio
    return [view.select(axis, block * ratio + j) for j in range(ratio)]


def describe(geometry: KVCacheGeometry) -> str:
    fields = (f.name for f in dataclasses.fields(geometry) if f.init)
    return ", ".join(f"{name}={getattr(geometry, name)!r}" for name in fields)
