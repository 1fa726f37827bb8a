"""Every rejection path of the geometry core: the right error, field, problem and choices.

Each case checks that the error is a :class:`GeometryError` naming the offending field, that
the message states the problem, and — where the code has a finite set of alternatives —
that it lists exactly those accepted values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from elastickv.geometry import (
    KV_CACHE_DTYPES,
    LAYOUT_NAMES,
    GeometryError,
    KVCacheGeometry,
    KVLayout,
    build_layer_views,
    layout_from_stride_order,
    scale_views,
    split_kv,
    vllm028_layout,
)
from elastickv.geometry.report import explain

# 2 layers, 3 blocks, 2 KV heads, 4 tokens, head 8, float16: page = 2*4*(8+8)*2 = 256 bytes.
BASE: dict[str, object] = {
    "num_layers": 2,
    "num_blocks": 3,
    "num_kv_heads": 2,
    "block_size": 4,
    "head_size": 8,
}
PAGE = 256
PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
PAGE_COMPACT = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")


def geometry(**params: object) -> KVCacheGeometry:
    return KVCacheGeometry(**{**BASE, **params})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Case:
    """One rejected geometry: the field to blame, phrases of the problem, the choices."""

    params: dict[str, object]
    field: str
    problem: tuple[str, ...]
    accepted: tuple[str, ...] | None = None
    # Values the accepted list must contain, where the full list is still growing.
    accepted_includes: tuple[str, ...] = ()


def check(err: GeometryError, case: Case) -> None:
    message = str(err)
    assert err.field == case.field, message
    assert message.startswith(f"{case.field}: "), message
    for phrase in case.problem:
        assert phrase in message, f"{phrase!r} not in {message!r}"
        assert phrase in err.problem
    if case.accepted is not None:
        assert err.accepted is not None, message
        assert tuple(str(a) for a in err.accepted) == case.accepted, message
    if case.accepted_includes:
        assert err.accepted is not None, message
        assert set(case.accepted_includes) <= {str(a) for a in err.accepted}, message
    if err.accepted is not None:
        assert f"(accepted: {', '.join(str(a) for a in err.accepted)})" in message
    else:
        assert "accepted" not in message


CONSTRUCTOR_CASES: dict[str, Case] = {
    # ------------------------------------------------------------- unknown names
    "unknown layout": Case(
        {"layout": "XYZ"}, "layout", ("unknown layout 'XYZ'",), tuple(LAYOUT_NAMES)
    ),
    "unknown dtype": Case(
        {"dtype": "int8"},
        "dtype",
        ("unsupported model dtype 'int8'",),
        ("float16", "half", "bfloat16", "float32", "float"),
    ),
    "unknown kv_cache_dtype": Case(
        {"kv_cache_dtype": "fp4"},
        "kv_cache_dtype",
        ("unknown KV cache dtype 'fp4'",),
        tuple(KV_CACHE_DTYPES),
    ),
    "unknown kind": Case(
        {"kind": "dense"},
        "kind",
        ("unknown attention kind 'dense'",),
        ("packed", "mla", "split_kv", "split_kv_block_first"),
    ),
    "unknown contract": Case(
        {"contract": "0.30"}, "contract", ("unknown vLLM contract '0.30'",), ("0.28", "0.32")
    ),
    # ------------------------------------------------------------- kernel blocks
    "kernel block size not dividing block size": Case(
        {"kernel_block_size": 3},
        "kernel_block_size",
        ("3 does not divide block_size 4",),
        ("1", "2", "4"),
    ),
    # ------------------------------------------------------------- legacy split K/V
    "split K/V under HND": Case(
        {"kind": "split_kv", "contract": "0.28", "layout": "HND"},
        "layout",
        ("legacy split K/V split_kv is NHD only", "got HND"),
        ("NHD", "LHBNC"),
    ),
    "block-first split K/V under HND": Case(
        {"kind": "split_kv_block_first", "contract": "0.28", "layout": "HND"},
        "layout",
        ("legacy split K/V split_kv_block_first is NHD only", "got HND"),
        accepted_includes=("NHD", "LBHNC"),
    ),
    "split K/V with a quantized row": Case(
        {"kind": "split_kv", "contract": "0.28", "layout": "NHD", "kv_cache_dtype": "nvfp4"},
        "kv_cache_dtype",
        ("nvfp4 is not supported for legacy split K/V",),
        ("auto", "fp8"),
    ),
    "split K/V with head_size_v != head_size": Case(
        {"kind": "split_kv", "contract": "0.28", "layout": "NHD", "head_size_v": 4},
        "head_size_v",
        ("legacy split K/V needs head_size_v == head_size",),
    ),
    "0.32 with legacy split K/V": Case(
        {"kind": "split_kv", "layout": "NHD"},
        "kind",
        ("vLLM 0.32 has no legacy split K/V shape (split_kv)",),
        ("packed", "mla"),
    ),
    "0.32 with legacy block-first split K/V": Case(
        {"kind": "split_kv_block_first", "layout": "NHD"},
        "kind",
        ("vLLM 0.32 has no legacy split K/V shape (split_kv_block_first)",),
        ("packed", "mla"),
    ),
    # ------------------------------------------------------------- quantized rows
    "MLA with a per-token-head mode": Case(
        {"kind": "mla", "kv_cache_dtype": "int8_per_token_head"},
        "kv_cache_dtype",
        ("int8_per_token_head is not supported for MLA",),
        ("auto", "fp8"),
    ),
    "nvfp4 under NHD": Case(
        {"kv_cache_dtype": "nvfp4", "head_size": 16, "layout": "NHD"},
        "layout",
        ("only contiguous under HND", "got LBNHC"),
        ("LBHNC", "BLHNC"),
    ),
    "nvfp4 cross-layer NHD": Case(
        {"kv_cache_dtype": "nvfp4", "head_size": 16, "layout": "BLNHC"},
        "layout",
        ("only contiguous under HND", "got BLNHC"),
        ("LBHNC", "BLHNC"),
    ),
    "nvfp4 head size": Case(
        {"kv_cache_dtype": "nvfp4", "head_size": 24},
        "head_size",
        ("nvfp4 needs a multiple of 16, got 24",),
    ),
    "nvfp4 with head_size_v != head_size": Case(
        {"kv_cache_dtype": "nvfp4", "head_size": 16, "head_size_v": 32},
        "head_size_v",
        ("nvfp4 needs head_size_v == head_size",),
    ),
    "int4 odd head size": Case(
        {"kv_cache_dtype": "int4_per_token_head", "head_size": 7},
        "head_size",
        ("int4 packs two values a byte: sizes must be even",),
    ),
    "int4 odd V head size": Case(
        {"kv_cache_dtype": "int4_per_token_head", "head_size": 8, "head_size_v": 9},
        "head_size",
        ("int4 packs two values a byte",),
    ),
    "int8 per-token-head scale alignment": Case(
        {"kv_cache_dtype": "int8_per_token_head", "head_size": 6},
        "head_size",
        ("fp32 scales must be 4-byte aligned", "(6, 6) must be multiples of 4"),
    ),
    "int4 per-token-head scale alignment": Case(
        {"kv_cache_dtype": "int4_per_token_head", "head_size": 4},
        "head_size",
        ("fp32 scales must be 4-byte aligned", "(2, 2)"),
    ),
    "fp8 per-token-head V scale alignment": Case(
        {"kv_cache_dtype": "fp8_per_token_head", "head_size": 8, "head_size_v": 10},
        "head_size",
        ("fp32 scales must be 4-byte aligned", "(8, 10)"),
    ),
    # ------------------------------------------------------------- padded pages
    "padded page smaller than its content": Case(
        {"page_size_padded": PAGE - 2},
        "page_size_padded",
        (f"{PAGE - 2} is smaller than the page content {PAGE}",),
    ),
    "padded pages with kernel blocks": Case(
        {"page_size_padded": 2 * PAGE, "kernel_block_size": 2},
        "kernel_block_size",
        ("padded pages forbid kernel-block splitting", "kernel_block_size == block_size (4)"),
    ),
    "padded pages with head slots outside the page (LHBNC)": Case(
        {"page_size_padded": 2 * PAGE, "layout": "LHBNC"},
        "layout",
        ("LHBNC interleaves head slots with pages", "cannot be padded"),
        PAGE_COMPACT,
    ),
    "padded pages with head slots outside the page (BHLNC)": Case(
        {"page_size_padded": 2 * PAGE, "layout": "BHLNC"},
        "layout",
        ("BHLNC interleaves head slots with pages", "cannot be padded"),
        PAGE_COMPACT,
    ),
    # ------------------------------------------------------------- 0.32 kernel split
    "0.32 kernel split of a cross-layer page": Case(
        {"layout": "BLHNC", "kernel_block_size": 2},
        "kernel_block_size",
        ("BLHNC does not store a block of one layer as one dense page", "2 kernel blocks"),
        ("LBHNC", "LBNHC"),
    ),
    "0.32 kernel split with head planes outside blocks": Case(
        {"layout": "LHBNC", "kernel_block_size": 1},
        "kernel_block_size",
        ("LHBNC does not store a block of one layer as one dense page", "4 kernel blocks"),
        ("LBHNC", "LBNHC"),
    ),
    # Block stride == page, yet the page's head slots are B pages apart: not dense.
    "0.32 kernel split of a page made sparse by a block stride override": Case(
        {"layout": "LHBNC", "kernel_block_size": 2, "block_stride": PAGE},
        "kernel_block_size",
        ("does not store a block of one layer as one dense page", f"page {PAGE}"),
        ("LBHNC", "LBNHC"),
    ),
    # One layer: block stride == page, but the kernel walk keeps the layer stride, which
    # would space the head slots (vLLM's own views alias here).
    "0.32 kernel split with head slots outside the layer axis": Case(
        {"layout": "BHLNC", "num_layers": 1, "kernel_block_size": 2},
        "kernel_block_size",
        ("head slots outside the layer axis",),
        ("LBHNC", "LBNHC"),
    ),
    # ------------------------------------------------------------- 0.28 contract
    "0.28 with a layer stride override": Case(
        {"contract": "0.28", "layer_stride": 4 * PAGE},
        "layer_stride",
        ("stride overrides are a vLLM 0.32 KVCacheTensor field",),
    ),
    "0.28 with a block stride override": Case(
        {"contract": "0.28", "block_stride": 4 * PAGE},
        "block_stride",
        ("stride overrides are a vLLM 0.32 KVCacheTensor field",),
    ),
    "0.28 packed under LHBNC": Case(
        {"contract": "0.28", "layout": "LHBNC"},
        "layout",
        ("vLLM 0.28 backends never produce LHBNC",),
        ("NHD", "HND", "LBHNC", "LBNHC", "BHLNC", "BLNHC"),
    ),
    "0.28 packed under BLHNC": Case(
        {"contract": "0.28", "layout": "BLHNC"},
        "layout",
        ("vLLM 0.28 backends never produce BLHNC",),
        ("NHD", "HND", "LBHNC", "LBNHC", "BHLNC", "BLNHC"),
    ),
    "0.28 MLA with head planes outside blocks": Case(
        {"contract": "0.28", "kind": "mla", "layout": "LHBNC"},
        "layout",
        ("vLLM 0.28 MLA caches are per layer",),
        accepted_includes=("LBHNC", "LBNHC"),
    ),
    "0.28 MLA under BHLNC": Case(
        {"contract": "0.28", "kind": "mla", "layout": "BHLNC"},
        "layout",
        ("vLLM 0.28 MLA caches are per layer",),
        accepted_includes=("LBHNC", "LBNHC"),
    ),
    "0.28 cross-layer padding": Case(
        {"contract": "0.28", "layout": "BLNHC", "page_size_padded": 2 * PAGE},
        "page_size_padded",
        ("vLLM 0.28 pads pages only for per-layer storage",),
        ("LBHNC", "LBNHC"),
    ),
    "0.28 cross-layer HND padding": Case(
        {"contract": "0.28", "layout": "BHLNC", "page_size_padded": 2 * PAGE},
        "page_size_padded",
        ("vLLM 0.28 pads pages only for per-layer storage",),
        ("LBHNC", "LBNHC"),
    ),
    # ------------------------------------------------------------- alignment
    "offset not element aligned": Case(
        {"offset": 1}, "offset", ("1 bytes is not a multiple of the 2-byte element alignment",)
    ),
    "block stride not element aligned": Case(
        {"block_stride": PAGE + 1},
        "block_stride",
        (f"{PAGE + 1} bytes is not a multiple of the 2-byte element alignment",),
    ),
    "layer stride not element aligned": Case(
        {"layer_stride": 3 * PAGE + 1},
        "layer_stride",
        ("is not a multiple of the 2-byte element alignment",),
    ),
    "padded page not element aligned": Case(
        {"page_size_padded": PAGE + 1, "dtype": "float32", "head_size": 4},
        "page_size_padded",
        (f"{PAGE + 1} bytes is not a multiple of the 4-byte element alignment",),
    ),
    "per-token-head offset not scale aligned": Case(
        {"kv_cache_dtype": "int8_per_token_head", "offset": 2},
        "offset",
        ("2 bytes is not a multiple of the 4-byte element alignment",),
    ),
    # ------------------------------------------------------------- overlapping overrides
    "block stride override inside a page": Case(
        {"block_stride": 32},
        "block_stride",
        ("(stride 32) overlaps the axes inside it", "views would alias"),
    ),
    # Only the layer stride was given: it is what to change, although B is the axis that
    # collides (B keeps its page stride, L now equals it).
    "layer stride override of one page": Case(
        {"layer_stride": PAGE},
        "layer_stride",
        ("overlaps the axes inside it", "views would alias"),
    ),
    "layer stride override inside a layer": Case(
        {"layer_stride": 2 * PAGE, "num_blocks": 3},
        "layer_stride",
        ("overlaps the axes inside it",),
    ),
    "both overrides colliding": Case(
        {"layer_stride": PAGE, "block_stride": PAGE},
        "block_stride",
        ("axis B (stride 256) overlaps the axes inside it (extent 512)",),
    ),
}


@pytest.mark.parametrize("case", CONSTRUCTOR_CASES.values(), ids=CONSTRUCTOR_CASES.keys())
def test_constructor_rejects(case: Case) -> None:
    with pytest.raises(GeometryError) as info:
        geometry(**case.params)
    check(info.value, case)


NON_POSITIVE = [
    ("num_layers", 0, 1),
    ("num_blocks", -1, 1),
    ("num_kv_heads", True, 1),
    ("block_size", 2.0, 1),
    ("head_size", 0, 1),
    ("head_size_v", 0, 1),
    ("offset", -2, 0),
    ("kernel_block_size", 0, 1),
    ("page_size_padded", 0, 1),
    ("layer_stride", -PAGE, 1),
    ("block_stride", 0, 1),
]


@pytest.mark.parametrize(("name", "value", "minimum"), NON_POSITIVE)
def test_non_positive_fields_are_rejected(name: str, value: object, minimum: int) -> None:
    with pytest.raises(GeometryError) as info:
        geometry(**{name: value})
    check(info.value, Case({}, name, (f"must be an integer >= {minimum}, got {value!r}",)))


def test_mla_head_size_v_may_be_zero_but_not_negative() -> None:
    assert geometry(kind="mla", head_size_v=0).v_head_size == 0
    with pytest.raises(GeometryError) as info:
        geometry(kind="mla", head_size_v=-1)
    check(info.value, Case({}, "head_size_v", ("must be an integer >= 0, got -1",)))


# ------------------------------------------------------------------------ stride orders


@pytest.mark.parametrize(
    ("order", "problem", "accepted"),
    [
        ((0, 1, 2), "(0, 1, 2) is not a permutation of 0..3 (per layer) or 0..4", None),
        ((0, 1, 1, 3), "(0, 1, 1, 3) is not a permutation of 0..3", None),
        ((0, 1, 2, 3, 5), "is not a permutation of 0..3 (per layer) or 0..4", None),
        ((0, 1, 2, 3, 4, 5), "is not a permutation of 0..3 (per layer) or 0..4", None),
        ((0, 3, 1, 2), "gives physical order LBCHN, which no supported layout has", True),
        ((4, 3, 2, 1, 0), "gives physical order CNHBL, which no supported layout has", True),
        ((2, 0, 1, 3, 4), "gives physical order HLBNC, which no supported layout has", True),
    ],
)
def test_layout_from_stride_order_rejects(
    order: tuple[int, ...], problem: str, accepted: bool | None
) -> None:
    with pytest.raises(GeometryError) as info:
        layout_from_stride_order(order)
    names = tuple(m.name for m in KVLayout) if accepted else None
    check(info.value, Case({}, "stride_order", (problem,), names))


def test_vllm028_layout_rejects_unknown_names() -> None:
    for cross_layer in (False, True):
        with pytest.raises(GeometryError) as info:
            vllm028_layout("LHBNC", cross_layer)
        check(info.value, Case({}, "layout", ("'LHBNC' under the 0.28 contract",), ("NHD", "HND")))


# ------------------------------------------------------------------------ views


BackingFactory = Callable[[int], torch.Tensor]

BACKING_CASES: dict[str, tuple[dict[str, object], BackingFactory, str]] = {
    "too small": (
        {},
        lambda n: torch.zeros(n - 1, dtype=torch.uint8),
        "holds {short} bytes; the geometry needs {n}",
    ),
    "wrong dtype": (
        {},
        lambda n: torch.zeros(n, dtype=torch.float16),
        "must be a flat 1-byte tensor, got torch.float16 ({n},)",
    ),
    "not flat": (
        {},
        lambda n: torch.zeros(2, n, dtype=torch.uint8),
        "must be a flat 1-byte tensor, got torch.uint8 (2, {n})",
    ),
    "not contiguous": (
        {},
        lambda n: torch.zeros(2 * n, dtype=torch.uint8)[::2],
        "must be contiguous, got stride 2",
    ),
    "misaligned for float16": (
        {},
        lambda n: torch.zeros(n + 1, dtype=torch.uint8)[1:],
        "storage offset is not 2-byte aligned",
    ),
    "misaligned for per-token-head fp32 scales": (
        {"kv_cache_dtype": "int8_per_token_head"},
        lambda n: torch.zeros(n + 2, dtype=torch.uint8)[2:],
        "storage offset is not 4-byte aligned",
    ),
}


@pytest.mark.parametrize("name", BACKING_CASES)
def test_build_layer_views_rejects_bad_backings(name: str) -> None:
    params, make, problem = BACKING_CASES[name]
    g = geometry(**params)
    n = g.backing_bytes
    with pytest.raises(GeometryError) as info:
        build_layer_views(g, make(n))
    check(info.value, Case({}, "backing", (problem.format(n=n, short=n - 1),)))


def test_a_good_backing_is_accepted_at_every_aligned_offset() -> None:
    g = geometry(kv_cache_dtype="int8_per_token_head")
    storage = torch.zeros(g.backing_bytes + 8, dtype=torch.uint8)
    for lead in (0, 4, 8):
        views = build_layer_views(g, storage[lead : lead + g.backing_bytes])
        assert len(views) == g.num_layers
        scale_views(g, views[0])  # the fp32 scales are viewable: aligned


def test_split_kv_rejects_mla() -> None:
    for contract in ("0.28", "0.32"):
        g = geometry(kind="mla", contract=contract)
        view = build_layer_views(g, torch.zeros(g.backing_bytes, dtype=torch.uint8))[0]
        with pytest.raises(GeometryError) as info:
            split_kv(g, view)
        check(info.value, Case({}, "kind", ("an MLA latent cache has no K/V split",)))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "nvfp4"])
def test_scale_views_reject_modes_without_per_token_head_scales(kv_cache_dtype: str) -> None:
    g = geometry(kv_cache_dtype=kv_cache_dtype, head_size=16)
    view = build_layer_views(g, torch.zeros(g.backing_bytes, dtype=torch.uint8))[0]
    with pytest.raises(GeometryError) as info:
        scale_views(g, view)
    quant = g.quant.value
    check(
        info.value,
        Case({}, "kv_cache_dtype", (f"{quant} has no per-token-head scales",), PER_TOKEN_HEAD),
    )


# ------------------------------------------------------------------------ indices and pages


def test_block_and_layer_indices_are_range_checked() -> None:
    g = geometry()
    with pytest.raises(IndexError, match=r"block 3 out of range \[0, 3\)"):
        g.block_byte_ranges(3)
    with pytest.raises(IndexError, match=r"block -1 out of range \[0, 3\)"):
        g.block_pages(-1, 4096)
    with pytest.raises(IndexError, match=r"layer 2 out of range \[0, 2\)"):
        g.block_byte_ranges(0, layer=2)
    with pytest.raises(IndexError, match=r"layer -1 out of range \[0, 2\)"):
        g.layer_offset(-1)


@pytest.mark.parametrize("page_size", [0, -4096])
def test_block_pages_rejects_non_positive_page_sizes(page_size: int) -> None:
    with pytest.raises(GeometryError) as info:
        geometry().block_pages(0, page_size)
    check(info.value, Case({}, "page_size", (f"must be an integer >= 1, got {page_size}",)))


def test_explain_rejects_non_positive_page_sizes() -> None:
    with pytest.raises(ValueError, match="page_size must be positive, got 0"):
        explain(geometry(), page_size=0)
