"""Contract: our views are exactly the KV-cache views real vLLM 0.32 builds.

vLLM side, all vLLM's own code: the spec a layer publishes (``FullAttentionSpec`` /
``MLAAttentionSpec``) adjusted by the backend's ``customize_spec`` (Triton's for the
per-token-head modes, MLA's for latents, FlashInfer's for NVFP4), the ``KVCacheTensor``
placement ``get_kv_cache_config_from_groups`` computes with ``compute_layout_strides``, and
the per-layer views ``allocate_kv_cache`` builds with ``create_kv_cache_views``. Only the
config objects around them are minimal stand-ins.

Our side: ``KVCacheGeometry(contract="0.32")`` from the same fields, half of the time also
given vLLM's ``offset / layer_stride / block_stride`` (the other half it must derive them).

Per case: shape, stride, storage offset and dtype of every layer; rejection agreement (vLLM
raises exactly when we raise ``GeometryError``); distinct values written through our views
read back identically through vLLM's own interpretation of the bytes (packed K/V:
``transpose(1, 2).split(head_size, -1)``; per-token-head: Triton's inline fp32 scale views;
NVFP4: ``split(num_kv_heads, 1)`` + ``nvfp4_split_data_scale``), and writing those values
through vLLM's views yields the same backing bytes; every (layer, block) byte range equals
the bytes vLLM's view of that block touches.

Backends: ``FlashInferBackend`` imports ``flashinfer``, which this CPU machine lacks; when
it is not importable the NVFP4 spec is the exact ``replace`` its ``customize_spec`` applies
(with vLLM's own ``nvfp4_kv_cache_full_dim``). Deliberate divergence: we reject NVFP4
outside the head-major layouts (LBHNC, BLHNC — what FlashInfer's trtllm-gen path declares
in ``supported_kv_cache_layouts``). Under dense NHD pages vLLM 0.32's FlashInfer
(``_nvfp4_kv_views``, fa2 path) reads each page as ``[K data | K scale | V data | V scale]``
with ``(N, H)`` inside a side, so its K/V are not the head slots of the view; we do not model
that interpretation and fail closed.

Not covered here (no 0.32 kind expresses them): B12X and ROCM_ATTN publish K and V as two
head slots of ``H * D`` content each (``customize_spec`` sets ``num_head_slots=2``), i.e.
split K/V planes in 0.32 form; the CPU backend's ``vec`` kernel stores K transposed inside a
(block, head) page, so its K/V are not ``transpose(1, 2).split`` halves (its views and
block bytes are still the packed LBHNC ones checked here). Also covered: a group mixing two
layer specs, where vLLM places the second ``KVCacheTensor`` at a nonzero ``offset``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from contract_helpers import (
    as_int,
    mark,
    packed_side_pairs,
    raw_backing,
    touched_runs,
    write_pattern,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.utils.torch_utils import (
    STR_DTYPE_TO_TORCH_DTYPE,
    get_dtype_size,
    nvfp4_kv_cache_full_dim,
    nvfp4_split_data_scale,
)
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from elastickv.geometry import (
    GeometryError,
    KVCacheGeometry,
    KVLayout,
    build_layer_views,
    layer_views,
    nvfp4_data_scale,
    scale_views,
    split_kv,
)

try:
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend
except ImportError as exc:  # no flashinfer on a CPU machine
    FlashInferBackend = None
    FLASHINFER_IMPORT_ERROR: str | None = repr(exc)
else:
    FLASHINFER_IMPORT_ERROR = None

pytestmark = pytest.mark.vllm

LAYOUTS = tuple(m.name for m in KVCacheLayout)
DTYPES = ("float16", "bfloat16", "float32")
PACKED_MODES = ("auto", "fp8", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
MLA_MODES = ("mla", "mla_fp8")
MODES = (*PACKED_MODES, "nvfp4", *MLA_MODES)
# The layouts FlashInfer's NVFP4 (trtllm-gen) kernels declare: head-major block interiors.
NVFP4_LAYOUTS = ("LBHNC", "BLHNC")
# Head sizes each mode can take (per-token-head scales need 4-byte aligned data).
HEAD_SIZES = {
    "auto": (8, 32, 64, 96, 128),
    "fp8": (8, 32, 64, 128),
    "int8_per_token_head": (4, 32, 64, 128),
    "fp8_per_token_head": (4, 32, 64, 128),
    "int4_per_token_head": (8, 32, 64, 128),
    "nvfp4": (16, 32, 64, 128),
    "mla": (64, 320, 576),
    "mla_fp8": (64, 320, 576),
}


@dataclass(frozen=True)
class Case:
    """One geometry, described once for both vLLM and us."""

    layout: str
    mode: str
    dtype: str
    num_layers: int
    num_blocks: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    block_size: int
    ratio: int = 1
    pad: int | None = None  # bytes past the page content (page_size_padded), non-MLA
    mla_alignment: int | None = None  # MLAAttentionSpec.alignment (pads the page)
    use_tensor_strides: bool = True

    @property
    def is_mla(self) -> bool:
        return self.mode in MLA_MODES

    @property
    def kv_cache_dtype(self) -> str:
        return {"mla": "auto", "mla_fp8": "fp8"}.get(self.mode, self.mode)

    @property
    def kernel_block_size(self) -> int:
        return self.block_size // self.ratio


def vllm_spec(case: Case) -> Any:
    """The spec the layer would publish, after its backend's ``customize_spec``."""
    quant = case.kv_cache_dtype
    dtype = getattr(torch, case.dtype) if quant == "auto" else STR_DTYPE_TO_TORCH_DTYPE[quant]
    if case.is_mla:
        spec = MLAAttentionSpec(
            block_size=case.block_size,
            num_kv_heads=1,
            head_size=case.head_size,
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(quant),
            cache_dtype_str=quant,
            alignment=case.mla_alignment,
        )
        return MLACommonBackend.customize_spec(spec)
    spec = FullAttentionSpec(
        block_size=case.block_size,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        head_size_v=case.head_size_v,
        dtype=dtype,
        kv_quant_mode=get_kv_quant_mode(quant),
    )
    if case.mode == "nvfp4":
        spec = flashinfer_customize_spec(spec)
    else:
        spec = TritonAttentionBackend.customize_spec(spec)
    if case.pad is not None:
        spec = replace(spec, page_size_padded=spec.page_size_bytes + case.pad)
    return spec


def flashinfer_customize_spec(spec: Any) -> Any:
    """FlashInfer's NVFP4 spec: its real ``customize_spec`` when importable."""
    if FlashInferBackend is not None:
        return FlashInferBackend.customize_spec(spec)
    full_dim = nvfp4_kv_cache_full_dim(spec.head_size)
    return replace(
        spec,
        num_head_slots=2 * spec.num_kv_heads,
        state_content_bytes=full_dim * get_dtype_size(spec.dtype),
    )


def allocate(
    layout_name: str, num_blocks: int, group: Any, kernel_block_size: int
) -> tuple[Any, dict[str, torch.Tensor]]:
    """vLLM's ``KVCacheConfig`` for one group, and its views from ``allocate_kv_cache``."""
    layout = KVCacheLayout[layout_name]
    cache_config = types.SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=num_blocks,
        prefix_cache_retention_interval=None,
    )
    vllm_config = types.SimpleNamespace(
        cache_config=cache_config,
        attention_config=types.SimpleNamespace(hisparse_config=None),
    )
    config = get_kv_cache_config_from_groups(vllm_config, [group], available_memory=1 << 40)
    caches = allocate_kv_cache(
        config, torch.device("cpu"), layout, kernel_block_sizes=[kernel_block_size]
    )
    return config, caches


def vllm_views(case: Case, spec: Any) -> tuple[Any, list[torch.Tensor]]:
    """vLLM's ``KVCacheConfig`` and per-layer views for one uniform group of layers."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(case.num_layers)]
    group = KVCacheGroupSpec(names, spec)
    config, caches = allocate(case.layout, case.num_blocks, group, case.kernel_block_size)
    return config, [caches[name] for name in names]


def our_geometry(case: Case, spec: Any, tensor: Any | None) -> KVCacheGeometry:
    strides: dict[str, int] = {}
    if tensor is not None:
        strides = {
            "offset": tensor.offset,
            "layer_stride": tensor.layer_stride,
            "block_stride": tensor.block_stride,
        }
    return KVCacheGeometry(
        num_layers=case.num_layers,
        num_blocks=case.num_blocks,
        num_kv_heads=1 if case.is_mla else case.num_kv_heads,
        block_size=case.block_size,
        head_size=case.head_size,
        head_size_v=None if case.is_mla else case.head_size_v,
        dtype=case.dtype,
        kv_cache_dtype=case.kv_cache_dtype,
        layout=case.layout,
        kind="mla" if case.is_mla else "packed",
        kernel_block_size=case.kernel_block_size,
        page_size_padded=spec.page_size_padded,
        contract="0.32",
        **strides,
    )


def view_facts(view: torch.Tensor) -> tuple[object, ...]:
    return tuple(view.shape), view.stride(), view.storage_offset(), view.dtype


def check_case(case: Case) -> str:
    """Compare one case end to end; return what happened (for hypothesis statistics)."""
    spec = vllm_spec(case)
    try:
        config, theirs = vllm_views(case, spec)
    except (ValueError, AssertionError, RuntimeError):
        # RuntimeError: vLLM's as_strided view runs past its own allocation.
        with pytest.raises(GeometryError):
            our_geometry(case, spec, None)
        return "both reject"
    if views_alias(theirs):
        # vLLM built views in which two elements share a byte: we must refuse them.
        with pytest.raises(GeometryError):
            our_geometry(case, spec, None)
        return "vLLM's views alias; we reject"
    if case.mode == "nvfp4" and case.layout not in NVFP4_LAYOUTS:
        with pytest.raises(GeometryError, match="nvfp4"):
            our_geometry(case, spec, None)
        return "nvfp4 outside HND: we reject"
    (tensor,) = config.kv_cache_tensors
    geometry = our_geometry(case, spec, tensor if case.use_tensor_strides else None)
    assert (geometry.offset, geometry.layer_stride_bytes, geometry.block_stride_bytes) == (
        tensor.offset,
        tensor.layer_stride,
        tensor.block_stride,
    )
    assert geometry.backing_bytes <= tensor.size
    ours = layer_views(geometry)
    assert len(ours) == len(theirs)
    for layer, (mine, vllm_view) in enumerate(zip(ours, theirs, strict=True)):
        expected = view_facts(vllm_view)
        assert (mine.shape, mine.stride, mine.storage_offset, mine.dtype) == expected, layer
    check_distinct_values(case, geometry, theirs)
    check_block_bytes(geometry, theirs)
    return f"views equal ({case.mode})"


def views_alias(views: list[torch.Tensor]) -> bool:
    """Whether any two elements of ``views`` (all layers) share a backing byte."""
    raw = raw_backing(views[0])
    raw.zero_()
    for view in views:
        mark(view)
    covered = sum(end - start for start, end in touched_runs(raw))
    return covered < sum(view.numel() * view.element_size() for view in views)


def part_pairs(
    case: Case, geometry: KVCacheGeometry, mine: torch.Tensor, theirs: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(our part, vLLM's part) of one layer: the same logical elements, cut both ways."""
    if case.is_mla:
        return [(mine, theirs)]
    if case.mode == "nvfp4":
        our_sides = split_kv(geometry, mine)
        their_sides = torch.split(theirs, case.num_kv_heads, dim=1)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for our_side, their_side in zip(our_sides, their_sides, strict=True):
            pairs.extend(
                zip(nvfp4_data_scale(our_side), nvfp4_split_data_scale(their_side), strict=True)
            )
        return pairs
    our_k, our_v = split_kv(geometry, mine)
    scales = scale_views(geometry, mine) if case.mode not in ("auto", "fp8") else None
    return packed_side_pairs((our_k, our_v), scales, theirs, case.head_size, case.head_size_v)


def check_distinct_values(
    case: Case, geometry: KVCacheGeometry, theirs: list[torch.Tensor]
) -> None:
    """Values written through our views are what vLLM's interpretation reads, byte for byte."""
    raw = raw_backing(theirs[0])
    ours = build_layer_views(geometry, raw)
    pairs = [
        (index, pair)
        for layer, (mine, vllm_view) in enumerate(zip(ours, theirs, strict=True))
        for index, pair in enumerate(part_pairs(case, geometry, mine, vllm_view), 8 * layer)
    ]
    raw.zero_()
    written = [
        (their_part, write_pattern(our_part, salt)) for salt, (our_part, their_part) in pairs
    ]
    for their_part, values in written:
        assert torch.equal(as_int(their_part), values)
    ours_bytes = raw.clone()
    raw.zero_()
    for their_part, values in written:
        as_int(their_part).copy_(values)
    assert torch.equal(raw, ours_bytes)


def check_block_bytes(geometry: KVCacheGeometry, theirs: list[torch.Tensor]) -> None:
    """Each (layer, block) byte range is exactly what vLLM's view of that block touches."""
    raw = raw_backing(theirs[0])
    ratio = geometry.kernel_ratio
    for block in range(geometry.num_blocks):
        for layer, view in enumerate(theirs):
            raw.zero_()
            mark(view[block * ratio : (block + 1) * ratio])
            assert touched_runs(raw) == geometry.block_byte_ranges(block, layer), (block, layer)
        raw.zero_()
        for view in theirs:
            mark(view[block * ratio : (block + 1) * ratio])
        assert touched_runs(raw) == geometry.block_byte_ranges(block), block


@st.composite
def cases(draw: st.DrawFn) -> Case:
    mode = draw(st.sampled_from(MODES))
    head_size = draw(st.sampled_from(HEAD_SIZES[mode]))
    head_size_v = head_size
    if mode in ("auto", "fp8"):
        head_size_v = draw(st.sampled_from((head_size, head_size // 2, 2 * head_size)))
    mla = mode in MLA_MODES
    return Case(
        layout=draw(st.sampled_from(LAYOUTS)),
        mode=mode,
        dtype=draw(st.sampled_from(DTYPES)),
        num_layers=draw(st.integers(1, 3)),
        num_blocks=draw(st.integers(1, 4)),
        num_kv_heads=1 if mla else draw(st.integers(1, 4)),
        head_size=head_size,
        head_size_v=0 if mla else head_size_v,
        block_size=draw(st.sampled_from((16, 32, 64))),
        ratio=draw(st.sampled_from((1, 1, 2, 4))),
        pad=None if mla else draw(st.sampled_from((None, None, None, 16, 512))),
        mla_alignment=draw(st.sampled_from((None, 512, 4096))) if mla else None,
        use_tensor_strides=draw(st.booleans()),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_views_match_vllm_sweep(case: Case) -> None:
    event(check_case(case))


def _llama(layout: str, **changes: Any) -> Case:
    base = Case(layout, "auto", "bfloat16", 2, 3, 8, 128, 128, 16)
    return replace(base, **changes)


EXPLICIT_CASES = [
    *(pytest.param(_llama(name), id=f"llama-{name}") for name in LAYOUTS),
    *(
        pytest.param(_llama(name, ratio=2, dtype="float16"), id=f"kernel2-{name}")
        for name in LAYOUTS
    ),
    # The CPU backend's default: 128-token blocks read as 32-token kernel blocks, HND.
    pytest.param(
        _llama(
            "LBHNC",
            block_size=128,
            ratio=4,
            dtype="float32",
            num_kv_heads=2,
            head_size=32,
            head_size_v=32,
        ),
        id="cpu-default",
    ),
    pytest.param(_llama("BLNHC", mode="int4_per_token_head", ratio=4, block_size=64), id="int4"),
    pytest.param(_llama("LHBNC", mode="int8_per_token_head", dtype="float16"), id="int8-pth"),
    pytest.param(_llama("BHLNC", mode="fp8_per_token_head"), id="fp8-pth"),
    pytest.param(_llama("LBNHC", mode="fp8", pad=4096), id="fp8-padded"),
    pytest.param(_llama("BLHNC", pad=64, use_tensor_strides=False), id="padded-cross"),
    pytest.param(_llama("BHLNC", pad=64), id="padded-interleaved-rejected"),
    pytest.param(_llama("LHBNC", pad=64), id="padded-head-planes-rejected"),
    pytest.param(_llama("LBHNC", head_size=192, head_size_v=128), id="diffkv-192-128"),
    pytest.param(_llama("LBHNC", mode="nvfp4", ratio=2), id="nvfp4-per-layer"),
    pytest.param(_llama("BLHNC", mode="nvfp4", head_size=64, head_size_v=64), id="nvfp4-cross"),
    pytest.param(_llama("LBNHC", mode="nvfp4"), id="nvfp4-nhd-rejected"),
    pytest.param(
        _llama(
            "LBNHC",
            mode="mla",
            num_kv_heads=1,
            head_size=576,
            head_size_v=0,
            block_size=64,
            mla_alignment=4096,
        ),
        id="mla-576-aligned",
    ),
    pytest.param(
        _llama(
            "BLHNC",
            mode="mla_fp8",
            num_kv_heads=1,
            head_size=576,
            head_size_v=0,
            block_size=64,
            ratio=2,
        ),
        id="mla-fp8-cross-split-rejected",
    ),
    pytest.param(
        _llama(
            "BHLNC", mode="mla", num_kv_heads=1, head_size=320, head_size_v=0, ratio=2, num_layers=1
        ),
        id="mla-one-layer-split",
    ),
]


@pytest.mark.parametrize("case", EXPLICIT_CASES)
def test_views_match_vllm_explicit(case: Case) -> None:
    check_case(case)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_names_and_properties_match_vllm(name: str) -> None:
    theirs, ours = KVCacheLayout[name], KVLayout[name]
    assert ours.value == theirs.value
    assert ours.is_layer_outermost == theirs.is_layer_compact
    assert ours.is_page_compact == theirs.is_block_compact
    assert ours.is_block_outermost == theirs.is_block_outermost
    assert KVLayout.parse("NHD") is KVLayout.LBNHC and KVLayout.parse("HND") is KVLayout.LBHNC


def test_bhlnc_single_layer_kernel_split_is_rejected_by_both() -> None:
    """A vLLM 0.32 edge case: BHLNC, one layer, kernel-split blocks.

    With one layer the block passes vLLM's dense-page check, but the fixed layer stride
    still sets the head stride, so kernel block 1 of a block would be head 1 of kernel
    block 0 and the last view runs past the allocation: vLLM fails inside ``as_strided``.
    We refuse the same geometry up front.
    """
    case = _llama("BHLNC", num_layers=1, num_blocks=3, num_kv_heads=2, ratio=2)
    with pytest.raises(RuntimeError, match="out of bounds"):
        vllm_views(case, vllm_spec(case))
    with pytest.raises(GeometryError, match="kernel_block_size"):
        our_geometry(case, vllm_spec(case), None)


def test_kernel_split_rejections_agree_on_the_reason() -> None:
    """vLLM refuses to split a non-dense block; we refuse with a message naming the field."""
    case = _llama("BLHNC", ratio=2)
    with pytest.raises(ValueError, match="dense"):
        vllm_views(case, vllm_spec(case))
    with pytest.raises(GeometryError, match="kernel_block_size"):
        our_geometry(case, vllm_spec(case), None)


@pytest.mark.parametrize("name", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_mixed_page_sizes_give_each_spec_its_offset(name: str) -> None:
    """Two layer specs in one group: vLLM packs them with offsets; each is one geometry."""
    heads = {0: 2, 1: 1, 2: 2, 3: 1}  # interleaved, so two KVCacheTensors
    specs = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=16, num_kv_heads=h, head_size=64, dtype=torch.float16
        )
        for i, h in heads.items()
    }
    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs.from_specs(specs))
    config, caches = allocate(name, 3, group, 16)
    assert len(config.kv_cache_tensors) == 2 and config.kv_cache_tensors[1].offset > 0
    geometries = []
    for tensor in config.kv_cache_tensors:
        spec = specs[tensor.layers[0]]
        case = Case(name, "auto", "float16", len(tensor.layers), 3, spec.num_kv_heads, 64, 64, 16)
        geometry = our_geometry(case, spec, tensor)
        theirs = [caches[layer] for layer in tensor.layers]
        for mine, vllm_view in zip(layer_views(geometry), theirs, strict=True):
            assert (mine.shape, mine.stride, mine.storage_offset, mine.dtype) == view_facts(
                vllm_view
            )
        check_distinct_values(case, geometry, theirs)
        check_block_bytes(geometry, theirs)
        geometries.append(geometry)
    for block in range(3):
        first, second = (_bytes(g.block_byte_ranges(block)) for g in geometries)
        assert first and second and not first & second


def _bytes(ranges: list[tuple[int, int]]) -> set[int]:
    return {byte for start, end in ranges for byte in range(start, end)}
