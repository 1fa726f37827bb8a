"""The frozen description of one KV-cache tensor group, and the exact byte math behind it.

A geometry is the logical array ``[L, B, H, N, C]`` (layers, blocks, head slots, tokens per
block, content bytes per row) laid out in a :class:`KVLayout` order over one flat byte
backing, with optional per-page padding, optional kernel-block splitting and optional
``KVCacheTensor``-style ``offset / layer_stride / block_stride`` overrides. Everything else —
engine-facing views, per-block byte ranges, sizes — is derived from it here, once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

import torch

from elastickv.geometry.content import (
    SCALE_BYTES,
    KVQuant,
    RowFormat,
    model_dtype,
    nvfp4_row_bytes,
    storage_dtype,
)
from elastickv.geometry.errors import GeometryError
from elastickv.geometry.layout import AXIS_B, AXIS_H, AXIS_L, AXIS_N, KVLayout

ByteRange = tuple[int, int]  # [start, end) in bytes of the backing


class AttentionKind(enum.Enum):
    """The engine-facing per-layer tensor shape family."""

    PACKED = "packed"  # (B, H, N, K|V) — vLLM >= 0.28 attention
    MLA = "mla"  # (B, N, C) — one latent per token, no K/V split
    SPLIT_KV = "split_kv"  # legacy (2, B, N, H, D), K plane then V plane
    SPLIT_KV_BLOCK_FIRST = "split_kv_block_first"  # legacy (B, 2, N, H, D)

    @classmethod
    def parse(cls, value: str | AttentionKind) -> AttentionKind:
        if isinstance(value, AttentionKind):
            return value
        try:
            return cls(value.strip().lower().replace("-", "_"))
        except ValueError:
            raise GeometryError(
                "kind", f"unknown attention kind {value!r}", [k.value for k in cls]
            ) from None


class Contract(enum.Enum):
    """Which vLLM KV-cache contract the geometry follows.

    ``0.28`` (0.28–0.31): backends describe kernel-block shapes + stride orders; the
    physical unit is the kernel block, so any layout may split logical blocks.
    ``0.32``: one backing with ``KVCacheTensor`` strides at logical-block granularity;
    a logical block may only be split when it is one dense page.
    """

    V028 = "0.28"
    V032 = "0.32"

    @classmethod
    def parse(cls, value: str | Contract) -> Contract:
        if isinstance(value, Contract):
            return value
        try:
            return cls(str(value).strip())
        except ValueError:
            raise GeometryError(
                "contract", f"unknown vLLM contract {value!r}", [c.value for c in cls]
            ) from None


# The one physical layout each legacy split-K/V shape has (NHD inside each K or V plane).
_SPLIT_LAYOUTS = {
    AttentionKind.SPLIT_KV: KVLayout.LHBNC,
    AttentionKind.SPLIT_KV_BLOCK_FIRST: KVLayout.LBHNC,
}
# Cross-layer (B, L, 2, N, H, D): HPC_ATTN's layered stride order (1, 0, 2, 3, 4, 5) in 0.28.
_SPLIT_CROSS_LAYOUTS = {AttentionKind.SPLIT_KV_BLOCK_FIRST: KVLayout.BLHNC}
# What vLLM 0.28's stride orders produce for the packed shape, per layer and cross layer.
_V028_PACKED_LAYOUTS = (KVLayout.LBHNC, KVLayout.LBNHC, KVLayout.BHLNC, KVLayout.BLNHC)
# NVFP4 stores each side as "all data, then all scales", which needs [H, N, C] contiguous.
_NVFP4_LAYOUTS = (KVLayout.LBHNC, KVLayout.BLHNC)


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GeometryError(name, f"must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class KVCacheGeometry:
    """One KV-cache tensor group: where every byte of every layer's cache lives.

    ``num_blocks`` and ``block_size`` are the scheduler's (logical) blocks;
    ``kernel_block_size`` (default: ``block_size``) is what the attention kernel indexes,
    each logical block ``b`` being kernel blocks ``b*ratio .. b*ratio+ratio-1``.
    ``page_size_padded`` is the bytes one (layer, block) page occupies when larger than its
    content. ``offset``, ``layer_stride`` and ``block_stride`` (bytes) override the strides
    the layout implies, exactly like vLLM 0.32's ``KVCacheTensor``.
    """

    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_size: int
    head_size_v: int | None = None
    dtype: str = "float16"
    kv_cache_dtype: str = "auto"
    layout: KVLayout | str = KVLayout.LBHNC
    kind: AttentionKind | str = AttentionKind.PACKED
    kernel_block_size: int | None = None
    page_size_padded: int | None = None
    offset: int = 0
    layer_stride: int | None = None
    block_stride: int | None = None
    contract: Contract | str = Contract.V032

    quant: KVQuant = field(init=False, repr=False, compare=False)
    row: RowFormat = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kind = AttentionKind.parse(self.kind)
        contract = Contract.parse(self.contract)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "contract", contract)
        object.__setattr__(self, "layout", self._resolve_layout(kind, self.layout))
        for name in ("num_layers", "num_blocks", "num_kv_heads", "block_size", "head_size"):
            _positive(name, getattr(self, name))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _positive("head_size_v", self.v_head_size, minimum=0 if kind is AttentionKind.MLA else 1)
        _positive("offset", self.offset, minimum=0)
        kbs = self.kernel_block_size if self.kernel_block_size is not None else self.block_size
        _positive("kernel_block_size", kbs)
        object.__setattr__(self, "kernel_block_size", kbs)
        if self.block_size % kbs:
            raise GeometryError(
                "kernel_block_size",
                f"{kbs} does not divide block_size {self.block_size}",
                [d for d in range(1, self.block_size + 1) if self.block_size % d == 0],
            )
        quant = KVQuant.parse(self.kv_cache_dtype)
        object.__setattr__(self, "quant", quant)
        object.__setattr__(self, "row", self._row_format(kind, quant))
        for name in ("page_size_padded", "layer_stride", "block_stride"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        self._check_contract()
        self._validate_strides()

    # ------------------------------------------------------------------ validation

    @staticmethod
    def _resolve_layout(kind: AttentionKind, layout: KVLayout | str) -> KVLayout:
        if kind in _SPLIT_LAYOUTS:
            required = _SPLIT_LAYOUTS[kind]
            name = layout.name if isinstance(layout, KVLayout) else layout.strip().upper()
            if name in ("NHD", required.name):
                return required
            cross = _SPLIT_CROSS_LAYOUTS.get(kind)
            if cross is not None and name == cross.name:
                return cross
            raise GeometryError(
                "layout",
                f"legacy split K/V {kind.value} is NHD only; got {name}",
                ["NHD", required.name, *([cross.name] if cross is not None else [])],
            )
        return KVLayout.parse(layout)

    def _check_contract(self) -> None:
        """What each vLLM contract can express; anything else is rejected by name."""
        layout, kind = self.layout, self.kind
        assert isinstance(layout, KVLayout) and isinstance(kind, AttentionKind)
        if self.contract is Contract.V032:
            if kind in _SPLIT_LAYOUTS:
                raise GeometryError(
                    "kind",
                    f"vLLM 0.32 has no legacy split K/V shape ({kind.value})",
                    [AttentionKind.PACKED.value, AttentionKind.MLA.value],
                )
            return
        for name in ("layer_stride", "block_stride"):
            if getattr(self, name) is not None:
                raise GeometryError(name, "stride overrides are a vLLM 0.32 KVCacheTensor field")
        if kind is AttentionKind.PACKED and layout not in _V028_PACKED_LAYOUTS:
            raise GeometryError(
                "layout",
                f"vLLM 0.28 backends never produce {layout.name}",
                ["NHD", "HND", *(m.name for m in _V028_PACKED_LAYOUTS)],
            )
        if kind is AttentionKind.MLA and not layout.is_page_compact:
            # Per layer, or cross layer (B, L, N, C) as FlashMLA/TritonMLA's layered
            # stride order (1, 0, 2, 3) builds it.
            raise GeometryError(
                "layout",
                "vLLM 0.28 MLA caches are per layer or block-outermost cross layer",
                ["LBHNC", "LBNHC", "BLHNC", "BLNHC"],
            )
        if self.page_size_padded is not None and not layout.is_layer_outermost:
            raise GeometryError(
                "page_size_padded",
                "vLLM 0.28 pads pages only for per-layer storage",
                ["LBHNC", "LBNHC"],
            )

    @property
    def v_head_size(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v

    def _row_format(self, kind: AttentionKind, quant: KVQuant) -> RowFormat:
        dt = storage_dtype(quant, model_dtype(self.dtype))
        esize = torch.empty((), dtype=dt).element_size()
        dk, dv = self.head_size, self.v_head_size
        layout = self.layout
        assert isinstance(layout, KVLayout)
        if kind is AttentionKind.MLA:
            if quant not in (KVQuant.NONE, KVQuant.FP8):
                raise GeometryError(
                    "kv_cache_dtype", f"{quant.value} is not supported for MLA", ["auto", "fp8"]
                )
            width = dk * esize
            return RowFormat(dt, width, 0, width, width, 0, width)
        if kind in _SPLIT_LAYOUTS:
            if quant not in (KVQuant.NONE, KVQuant.FP8):
                raise GeometryError(
                    "kv_cache_dtype",
                    f"{quant.value} is not supported for legacy split K/V",
                    ["auto", "fp8"],
                )
            if dk != dv:
                raise GeometryError(
                    "head_size_v", "legacy split K/V needs head_size_v == head_size"
                )
            plane = self.num_kv_heads * dk * esize
            return RowFormat(dt, plane, 0, plane, 0, plane, plane)
        if quant is KVQuant.NVFP4:
            if dk != dv:
                raise GeometryError("head_size_v", "nvfp4 needs head_size_v == head_size")
            if dk % 16:
                raise GeometryError("head_size", f"nvfp4 needs a multiple of 16, got {dk}")
            if layout not in _NVFP4_LAYOUTS:
                raise GeometryError(
                    "layout",
                    f"nvfp4 splits each side into data then scales, which is only "
                    f"contiguous under HND; got {layout.name}",
                    [m.name for m in _NVFP4_LAYOUTS],
                )
            width = nvfp4_row_bytes(dk)
            return RowFormat(dt, width, 0, width, 0, width, width)
        if quant.is_per_token_head:
            if quant is KVQuant.INT4_PER_TOKEN_HEAD and (dk % 2 or dv % 2):
                raise GeometryError("head_size", "int4 packs two values a byte: sizes must be even")
            k_data = dk // 2 if quant is KVQuant.INT4_PER_TOKEN_HEAD else dk
            v_data = dv // 2 if quant is KVQuant.INT4_PER_TOKEN_HEAD else dv
            if k_data % SCALE_BYTES or v_data % SCALE_BYTES:
                raise GeometryError(
                    "head_size",
                    f"per-token-head fp32 scales must be 4-byte aligned: data bytes per side "
                    f"({k_data}, {v_data}) must be multiples of 4",
                )
            side_k = k_data + SCALE_BYTES
            return RowFormat(
                dt,
                side_k + v_data + SCALE_BYTES,
                k_offset=0,
                k_bytes=k_data,
                v_offset=side_k,
                v_bytes=v_data,
                side_bytes=side_k,
                k_scale_offset=k_data,
                v_scale_offset=side_k + v_data,
            )
        kb, vb = dk * esize, dv * esize
        return RowFormat(dt, kb + vb, 0, kb, kb, vb, kb)

    def _validate_strides(self) -> None:
        layout = self.layout
        assert isinstance(layout, KVLayout)
        esize = self.row.element_size
        if self.page_size_padded is not None:
            if self.page_size_padded < self.page_bytes:
                raise GeometryError(
                    "page_size_padded",
                    f"{self.page_size_padded} is smaller than the page content {self.page_bytes}",
                )
            if self.kernel_ratio > 1:
                raise GeometryError(
                    "kernel_block_size",
                    "padded pages forbid kernel-block splitting; use kernel_block_size == "
                    f"block_size ({self.block_size})",
                )
            outer = layout.order[: max(layout.order.index(AXIS_L), layout.order.index(AXIS_B)) + 1]
            if not layout.is_page_compact and self.num_head_slots > 1:
                raise GeometryError(
                    "layout",
                    f"{layout.name} interleaves head slots with pages ("
                    f"{''.join('LBHNC'[a] for a in outer)} outside the page), so pages cannot be "
                    "padded",
                    [m.name for m in KVLayout if m.is_page_compact],
                )
        logical = self._logical_strides
        # Dense: the block stride is the page and the page's rows tile it exactly (a stride
        # override can make block stride == page while head slots lie elsewhere).
        page_extent = (
            (self.num_head_slots - 1) * logical[AXIS_H]
            + (self.block_size - 1) * logical[AXIS_N]
            + self.row.content_bytes
        )
        # The kernel walk keeps the layer stride, which spaces head slots outside L (BHLNC).
        h_pos, l_pos = layout.order.index(AXIS_H), layout.order.index(AXIS_L)
        heads_outside_layers = self.num_head_slots > 1 and h_pos < l_pos
        if (
            self.contract is Contract.V032
            and self.kernel_ratio > 1
            and (
                logical[AXIS_B] != self.page_bytes
                or page_extent != self.page_bytes
                or heads_outside_layers
            )
        ):
            raise GeometryError(
                "kernel_block_size",
                f"{layout.name} does not store a block of one layer as one dense page (block "
                f"stride {logical[AXIS_B]}, page {self.page_bytes}, rows spanning "
                f"{page_extent} bytes"
                f"{', head slots outside the layer axis' if heads_outside_layers else ''}), "
                "so a block "
                f"cannot be split into {self.kernel_ratio} kernel blocks; use kernel_block_size "
                f"== block_size or a per-layer layout",
                ["LBHNC", "LBNHC"],
            )
        # The given values first, so a bad one is named rather than a stride derived from it.
        for name, value in (
            ("offset", self.offset),
            ("page_size_padded", self.page_size_padded or 0),
            ("layer_stride", self.layer_stride or 0),
            ("block_stride", self.block_stride or 0),
            ("layer_stride", self.view_strides[AXIS_L]),
            ("block_stride", self.view_strides[AXIS_B]),
        ):
            align = SCALE_BYTES if self.quant.is_per_token_head else esize
            if value % align:
                raise GeometryError(
                    name, f"{value} bytes is not a multiple of the {align}-byte element alignment"
                )
        # Non-overlap: ordered by stride, every axis must start past the extent of the
        # axes inside it. The named layouts satisfy this; stride overrides must too.
        pairs = enumerate(zip(self.view_strides, self.view_shape, strict=True))
        dims = sorted((s, n, a) for a, (s, n) in pairs if n > 1)
        extent = 1
        # Only overrides can overlap: when just one was given, it is the one to change.
        given = [n for n in ("layer_stride", "block_stride") if getattr(self, n) is not None]
        for stride, size, axis in dims:
            if stride < extent:
                raise GeometryError(
                    given[0]
                    if len(given) == 1
                    else "layer_stride"
                    if axis == AXIS_L
                    else "block_stride",
                    f"axis {'LBHNC'[axis]} (stride {stride}) overlaps the axes inside it "
                    f"(extent {extent}): views would alias",
                )
            extent = max(extent, stride * (size - 1) + extent)

    # ------------------------------------------------------------------ derived sizes

    @property
    def num_head_slots(self) -> int:
        """H of ``[B, H, N, C]``: KV heads, 2×heads for nvfp4, the K/V planes for split K/V."""
        assert isinstance(self.kind, AttentionKind)
        if self.kind is AttentionKind.MLA:
            return 1
        if self.kind in _SPLIT_LAYOUTS:
            return 2
        if self.quant is KVQuant.NVFP4:
            return 2 * self.num_kv_heads
        return self.num_kv_heads

    @property
    def kernel_ratio(self) -> int:
        assert self.kernel_block_size is not None
        return self.block_size // self.kernel_block_size

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * self.kernel_ratio

    @property
    def page_bytes(self) -> int:
        """Content bytes of one (layer, logical block): what a block costs per layer."""
        return self.num_head_slots * self.block_size * self.row.content_bytes

    @property
    def padded_page_bytes(self) -> int:
        return self.page_size_padded or self.page_bytes

    @cached_property
    def view_shape(self) -> tuple[int, ...]:
        """``[L, B', H, N', C]`` in kernel blocks (B' = B·ratio, N' = kernel block size)."""
        assert self.kernel_block_size is not None
        return (
            self.num_layers,
            self.num_kernel_blocks,
            self.num_head_slots,
            self.kernel_block_size,
            self.row.content_bytes,
        )

    @cached_property
    def _logical_strides(self) -> tuple[int, ...]:
        """vLLM 0.32's ``KVCacheTensor`` strides: laid out at logical-block granularity."""
        shape = (
            self.num_layers,
            self.num_blocks,
            self.num_head_slots,
            self.block_size,
            self.row.content_bytes,
        )
        return self._walk(shape, (self.layer_stride, self.block_stride))

    @cached_property
    def view_strides(self) -> tuple[int, ...]:
        """Byte strides of :attr:`view_shape` over the backing.

        0.28 lays the kernel-block shape out densely (the backend is asked for
        ``ratio × num_blocks`` blocks of ``kernel_block_size`` tokens); 0.32 keeps the
        logical ``KVCacheTensor`` strides and cuts a dense page into ``ratio`` pieces.
        """
        if self.contract is Contract.V028:
            return self._walk(self.view_shape, (None, None))
        layer, block = self._logical_strides[AXIS_L], self._logical_strides[AXIS_B]
        if self.kernel_ratio == 1:
            return self._logical_strides
        return self._walk(self.view_shape, (layer, block // self.kernel_ratio))

    def _walk(
        self, shape: tuple[int, ...], fixed: tuple[int | None, int | None]
    ) -> tuple[int, ...]:
        """Dense strides in physical order, innermost first, padding each page if asked."""
        layout = self.layout
        assert isinstance(layout, KVLayout)
        order = layout.order
        pad_at = max(order.index(AXIS_L), order.index(AXIS_B))
        strides = [0] * 5
        running = 1
        for position in range(4, -1, -1):
            axis = order[position]
            if self.page_size_padded is not None and position == pad_at:
                running = max(running, self.page_size_padded)
            override = fixed[axis] if axis in (AXIS_L, AXIS_B) else None
            strides[axis] = override if override is not None else running
            running = strides[axis] * shape[axis]
        return tuple(strides)

    @property
    def block_stride_bytes(self) -> int:
        """Distance between logical blocks ``b`` and ``b+1`` of one layer."""
        return self.view_strides[AXIS_B] * self.kernel_ratio

    @property
    def layer_stride_bytes(self) -> int:
        """Distance between layers ``l`` and ``l+1`` of one block."""
        return self.view_strides[AXIS_L]

    @cached_property
    def backing_bytes(self) -> int:
        """Bytes the backing must hold from its start (``offset`` included)."""
        pairs = list(zip(self.view_strides, self.view_shape, strict=True))
        span = max(stride * size for stride, size in pairs)
        last = sum((size - 1) * stride for stride, size in pairs) + 1
        if self.layer_stride is not None or self.block_stride is not None:
            # A KVCacheTensor sharing its blocks with others (vLLM 0.32 packs specs at
            # offsets): its strides tile the backing from byte 0, not from ``offset``.
            return max(self.offset + last, span)
        return self.offset + max(span, last)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.row.storage_dtype

    # ------------------------------------------------------------------ blocks

    def layer_offset(self, layer: int) -> int:
        """Byte offset of ``layer``'s block 0."""
        self._check_index("layer", layer, self.num_layers)
        return self.offset + layer * self.layer_stride_bytes

    def block_byte_ranges(self, block: int, layer: int | None = None) -> list[ByteRange]:
        """The bytes logical ``block`` occupies (one layer, or all), as sorted merged runs.

        These are exactly the bytes the views of that block touch: what an allocator must
        back with memory and what a transfer engine must copy.
        """
        self._check_index("block", block, self.num_blocks)
        layers = range(self.num_layers) if layer is None else [layer]
        runs: list[ByteRange] = []
        for lay in layers:
            base = self.layer_offset(lay) + block * self.block_stride_bytes
            runs.extend((base + start, base + end) for start, end in self._block_runs)
        return merge_ranges(runs)

    @cached_property
    def _block_runs(self) -> tuple[ByteRange, ...]:
        """Runs of one (layer, logical block) relative to its first byte."""
        _, _, heads, tokens, content = self.view_shape
        kernel_stride = self.view_strides[AXIS_B]
        dims = sorted(
            (
                (kernel_stride, self.kernel_ratio),
                (self.view_strides[AXIS_H], heads),
                (self.view_strides[AXIS_N], tokens),
            )
        )
        run, outer = content, list[tuple[int, int]]()
        for stride, size in dims:
            if size == 1:
                continue
            if stride == run and not outer:
                run *= size
            else:
                outer.append((stride, size))
        starts = [0]
        for stride, size in outer:
            starts = [s + i * stride for s in starts for i in range(size)]
        return tuple(merge_ranges([(s, s + run) for s in starts]))

    def block_pages(self, block: int, page_size: int) -> list[int]:
        """Indices of the ``page_size`` pages (of the backing) that ``block`` touches."""
        _positive("page_size", page_size)
        pages: list[int] = []
        for start, end in self.block_byte_ranges(block):
            first, last = start // page_size, (end - 1) // page_size
            if pages and pages[-1] >= first:
                first = pages[-1] + 1
            pages.extend(range(first, last + 1))
        return pages

    @staticmethod
    def _check_index(name: str, value: int, bound: int) -> None:
        if not 0 <= value < bound:
            raise IndexError(f"{name} {value} out of range [0, {bound})")


def merge_ranges(ranges: list[ByteRange]) -> list[ByteRange]:
    """Sort and coalesce touching or overlapping ``[start, end)`` ranges."""
    merged: list[ByteRange] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
