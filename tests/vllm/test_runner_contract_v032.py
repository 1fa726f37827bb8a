"""Contract: vLLM 0.32's own model runners place their KV cache on elastickv's storage exactly
as they place it natively, for both runners and every attention backend that imports here.

Runners: Model Runner V1 (``GPUModelRunner.initialize_kv_cache_tensors``, called on a runner
built without ``__init__`` that holds only what the method reads) and Model Runner V2 (the
module-level ``init_kv_cache`` its ``initialize_kv_cache`` calls). Both run with
``device=cuda:0`` on this CPU machine (see ``runner_contract``): natively, the one
``torch.zeros`` is a plain CPU tensor; elastically, the plugin's own placement
(``worker_v032.place_single_backing`` with its ``BackingMode``) answers it with a host range,
``memory_device="cpu"``, and checks every view against the geometry (``verify_views``).

vLLM side, its own code: the layer's spec as ``Attention`` / ``MLAAttention.
get_kv_cache_spec`` publish it, customised by the backend (``customize_attention_spec``), the
``KVCacheConfig`` from ``get_kv_cache_config_from_groups`` under the layout, the kernel block
sizes from ``prepare_kernel_block_sizes`` (and, as ``create_metadata_builders`` does, the
group's ``kernel_block_size`` when it differs), the runner's allocation, views and binding.

Matrix: every ``AttentionBackendEnum`` member (skipped with its import error when it does not
import here) × each of LBNHC (NHD) and LBHNC (HND) the backend declares it can consume ×
fp16 / bf16 / fp8 where it serves them (plus its own row formats, ``fp8_ds_mla`` and
TurboQuant's, which are refused) × V1 / V2. Per layer: the same shape, stride, offset and
dtype natively and elastically, for the views returned, bound to the layers and (V1) listed
by the runner; the elastic ones on the elastic range, inside it; every block's bytes, in
both, exactly the geometry's ``block_byte_ranges`` (the pages elastickv commits for it).
A combination the geometry cannot describe is refused with ``ElasticKVStartupError`` before
any memory is reserved: K and V as two head planes (ROCm's backends, B12X), a backend's own
row formats.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from runner_contract import (
    CUDA,
    OWN_ROW_FORMATS,
    RUNNERS,
    DtypeCell,
    NativeZeros,
    Placed,
    assert_block_bytes,
    assert_on_range,
    assert_same_views,
    bound_views,
    close_placement,
    dtype_cells,
    elastic_config,
    forward_context,
    layer_names,
    num_blocks_for,
    platform_backend_names,
    refused_before_memory,
    without_locals,
)
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVQuantMode,
    MLAAttentionSpec,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu import model_runner as v2_model_runner
from vllm.v1.worker.utils import (
    AttentionGroup,
    customize_attention_spec,
    prepare_kernel_block_sizes,
    select_common_block_size,
)
from vllm_backends import load_backends

from elastickv.integrations.vllm import preflight
from elastickv.integrations.vllm.worker import worker, worker_v032

pytestmark = pytest.mark.vllm

LAYOUTS = ("LBNHC", "LBHNC")  # NHD, HND
# customize_spec stores K and V as two head slots of H*D each: not a row the geometry has.
TWO_PLANE = ("ROCM_ATTN", "ROCM_SEGMENTED_ATTN", "B12X")
# Backends the CUDA platform selects that are placed here but not offered by the preflight.
NOT_IN_PREFLIGHT = {
    "FLASHMLA_SPARSE": "sparse MLA: its models also keep the indexer's cache",
    "FLASH_ATTN_MLA_SPARSE": "sparse MLA: its models also keep the indexer's cache",
    "FLASHINFER_MLA_SPARSE": "sparse MLA: its models also keep the indexer's cache",
    "FLASHINFER_MLA_SPARSE_SM90": "sparse MLA: its models also keep the indexer's cache",
    "FLASHINFER_MLA_SPARSE_SM120": "sparse MLA: its models also keep the indexer's cache",
}
FP8_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2")


BACKENDS, IMPORT_ERRORS = load_backends(AttentionBackendEnum)


def layouts(backend: Any) -> list[str]:
    declared = backend.supported_kv_cache_layouts()
    if declared is None:
        return list(LAYOUTS)
    return [name for name in LAYOUTS if KVCacheLayout[name] in declared]


def block_size(backend: Any) -> int:
    """A block size vLLM runs the backend with: 16 (CUDA's default) when the backend takes
    it, else the smallest of at least 16 tokens it takes."""
    sizes = backend.get_supported_kernel_block_sizes()
    if any(isinstance(s, MultipleOf) and 16 % s.base == 0 for s in sizes):
        return 16
    candidates = [-(-16 // s.base) * s.base if isinstance(s, MultipleOf) else int(s) for s in sizes]
    return int(min((s for s in candidates if s >= 16), default=max(candidates)))


def head_size(backend: Any, mla: bool) -> int:
    declared = list(backend.get_supported_head_sizes())
    preferred = 576 if mla else 64
    if not declared or preferred in declared:
        return preferred
    return int(min(declared))


@dataclass(frozen=True)
class Case:
    backend: str
    layout: str
    cell: DtypeCell
    runner: str
    split: bool = False  # blocks of two of the backend's largest kernel blocks

    @property
    def block_size(self) -> int:
        backend = BACKENDS[self.backend]
        if self.split:
            return 2 * max(int(s) for s in backend.get_supported_kernel_block_sizes())
        return block_size(backend)

    @property
    def expected_refusal(self) -> str | None:
        """The start-up error elastickv must give, or None where it must place the cache."""
        if self.cell.kv_cache_dtype in OWN_ROW_FORMATS:
            return "does not support KV quantization mode"
        if self.backend in TWO_PLANE:
            return "head slots of the backend's own rows"
        return None


def layer_spec(case: Case, backend: Any) -> Any:
    """The spec the layer publishes, customised by its backend, as the runner collects it."""
    kv = case.cell.kv_cache_dtype
    dtype = case.cell.model_dtype if kv == "auto" else STR_DTYPE_TO_TORCH_DTYPE[kv]
    mla = backend.is_mla()
    size = head_size(backend, mla)
    if mla:
        spec: Any = MLAAttentionSpec(
            block_size=case.block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=size,
            dtype=dtype,
            cache_dtype_str=kv,
            kv_quant_mode=get_kv_quant_mode(kv),
            state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(kv),
        )
    else:
        spec = FullAttentionSpec(
            block_size=case.block_size,
            num_kv_heads=4,
            head_size=size,
            head_size_v=size // 2 if case.backend.endswith("DIFFKV") else size,
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(kv),
        )
    return customize_attention_spec(backend, spec)


@dataclass
class Setup:
    backend: Any
    kv_cache_config: Any
    attn_groups: list[list[Any]]
    kernel_block_sizes: list[int]
    cache_config: Any


def setup(case: Case) -> Setup:
    backend = BACKENDS[case.backend]
    spec = layer_spec(case, backend)
    layout = KVCacheLayout[case.layout]
    cache_config = types.SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=num_blocks_for(spec.page_size_bytes),
        prefix_cache_retention_interval=None,
    )
    vllm_config = types.SimpleNamespace(
        cache_config=cache_config, attention_config=types.SimpleNamespace(hisparse_config=None)
    )
    group = KVCacheGroupSpec(layer_names(), spec)
    config = get_kv_cache_config_from_groups(vllm_config, [group], available_memory=1 << 40)
    attn_groups = [[AttentionGroup(backend, layer_names(), spec, 0)]]
    sizes = prepare_kernel_block_sizes(config, attn_groups)
    kernel = select_common_block_size(sizes[0], [backend], [spec])
    if kernel != spec.block_size:  # what create_metadata_builders records on the group
        attn_groups[0][0].kernel_block_size = kernel
    return Setup(backend, config, attn_groups, sizes, cache_config)


def original(function: Any) -> Any:
    return getattr(function, "__elastickv_original__", function)


def v1_runner(s: Setup) -> Any:
    """A V1 runner holding what ``initialize_kv_cache_tensors`` reads."""
    runner = gpu_model_runner.GPUModelRunner.__new__(gpu_model_runner.GPUModelRunner)
    runner.device = CUDA
    runner.cache_config = s.cache_config
    runner.shared_kv_cache_layers = {}
    runner.model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="llama"))
    runner.attn_groups = s.attn_groups
    runner.speculative_config = None
    runner.compilation_config = types.SimpleNamespace(static_forward_context=forward_context())
    runner.kv_caches = []
    return runner


def v2_config(s: Setup) -> Any:
    """The ``VllmConfig`` fields V2's ``init_kv_cache`` reads (its forward context holds
    stand-in layers, so no layer shares another's cache)."""
    return types.SimpleNamespace(
        cache_config=s.cache_config,
        attention_config=types.SimpleNamespace(hisparse_config=None),
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="llama")),
        compilation_config=types.SimpleNamespace(static_forward_context=forward_context()),
    )


def run(case: Case, s: Setup, elastic: bool) -> tuple[Placed, Any]:
    """One allocation by the case's runner: native (under :class:`NativeZeros`) or through
    the plugin's placement; returns what it built and the runner."""
    if case.runner == "V1":
        runner = v1_runner(s)
        tensors = original(gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors)
        context = runner.compilation_config.static_forward_context

        def allocate(mode: Any) -> dict[str, torch.Tensor]:
            views: dict[str, torch.Tensor] = tensors(
                runner, s.kv_cache_config, s.kernel_block_sizes, mode
            )
            return views

        listed: list[torch.Tensor] = runner.kv_caches
    else:
        runner = v2_model_runner.GPUModelRunner.__new__(v2_model_runner.GPUModelRunner)
        vllm_config = v2_config(s)
        context = vllm_config.compilation_config.static_forward_context
        init_kv_cache = original(v2_model_runner.init_kv_cache)
        groups = [group for groups in s.attn_groups for group in groups]

        def allocate(mode: Any) -> dict[str, torch.Tensor]:
            views: dict[str, torch.Tensor] = init_kv_cache(
                context,
                s.kv_cache_config,
                CUDA,
                s.kernel_block_sizes,
                vllm_config,
                mode,
                attn_groups=groups,
            )
            return views

        listed = []
    if elastic:
        views = worker_v032.place_single_backing(
            elastic_config(),
            runner,
            s.kv_cache_config,
            case.layout,
            s.kernel_block_sizes,
            CUDA,
            allocate,
            memory_device="cpu",
        )
        kv = worker.runner_kv(runner)
        assert kv is not None
        base = kv.backing().data_ptr()
    else:
        native = NativeZeros()
        with native:
            views = allocate(None)
        (buffer,) = native.buffers
        base = buffer.data_ptr()
    bases = dict.fromkeys(layer_names(), base)
    starts = dict.fromkeys(layer_names(), 0)
    return Placed(views, bound_views(context), list(listed), bases, starts), runner


def check(case: Case) -> None:
    s = setup(case)
    native, _ = run(case, s, elastic=False)
    expected = case.expected_refusal
    if expected is not None:
        with refused_before_memory(worker_v032, expected):
            run(case, s, elastic=True)
        return
    without_locals(lambda: check_placed(case, s, native))


def check_placed(case: Case, s: Setup, native: Placed) -> None:
    """The elastic run of a case whose cache elastickv places, against the native one."""
    elastic, runner = run(case, s, elastic=True)
    try:
        kv = worker.runner_kv(runner)
        assert kv is not None
        (tensor,) = s.kv_cache_config.kv_cache_tensors
        assert kv.size_bytes == tensor.size and kv.geometry.backing_bytes <= tensor.size
        assert kv.geometry.kernel_ratio == (2 if case.split else 1)
        assert_same_views(native, elastic)
        assert_on_range(elastic, kv.backing())
        assert_block_bytes(kv.geometry, elastic)
    finally:
        close_placement(runner)


def _cases() -> list[Any]:
    params: list[Any] = []
    for member in AttentionBackendEnum:
        name = member.name
        if name not in BACKENDS:
            reason = f"{name} does not import here: {IMPORT_ERRORS[name]}"
            params.extend(
                pytest.param(None, id=f"{runner}-{name}", marks=pytest.mark.skip(reason=reason))
                for runner in RUNNERS
            )
            continue
        backend = BACKENDS[name]
        cells = dtype_cells(backend)
        for layout in layouts(backend):
            for cell in cells:
                for runner in RUNNERS:
                    case = Case(name, layout, cell, runner)
                    params.append(pytest.param(case, id=f"{runner}-{name}-{layout}-{cell.name}"))
        if has_fixed_kernel_blocks(backend):
            for runner in RUNNERS:
                case = Case(name, layouts(backend)[0], cells[0], runner, split=True)
                params.append(
                    pytest.param(case, id=f"{runner}-{name}-{case.layout}-{cells[0].name}-split")
                )
    return params


def has_fixed_kernel_blocks(backend: Any) -> bool:
    """Whether a block of twice the natural size is split into kernel blocks."""
    return not any(isinstance(s, MultipleOf) for s in backend.get_supported_kernel_block_sizes())


CASES = _cases()


@pytest.mark.parametrize("case", CASES)
def test_runner_views_over_elastic_storage_equal_native(case: Case) -> None:
    check(case)


def matrix() -> list[Case]:
    return [p.values[0] for p in CASES if p.values[0] is not None]


def test_every_importable_backend_is_in_the_matrix() -> None:
    covered = {case.backend for case in matrix()}
    assert covered == set(BACKENDS), sorted(set(BACKENDS) - covered)
    for name, error in sorted(IMPORT_ERRORS.items()):
        print(f"not importable: {name}: {error}")


def test_two_plane_backends_are_what_vllm_customises() -> None:
    """The backends expected refused store K and V as two head slots in vLLM itself."""
    for name in TWO_PLANE:
        if name not in BACKENDS:
            continue
        cell = DtypeCell("bf16", torch.bfloat16, "auto")
        spec = layer_spec(Case(name, "LBHNC", cell, "V1"), BACKENDS[name])
        assert spec.num_head_slots == 2 and spec.num_kv_heads == 4, name


def placed_backends() -> set[str]:
    """Backends whose every fp16 / bf16 / fp8 cell is placed (and that have one)."""
    plain = [c for c in matrix() if c.cell.kv_cache_dtype not in OWN_ROW_FORMATS]
    names = {c.backend for c in plain}
    return {n for n in names if all(c.expected_refusal is None for c in plain if c.backend == n)}


def test_preflight_offers_exactly_the_placed_cuda_backends() -> None:
    """``--attention-backend`` on CUDA: every backend vLLM's CUDA platform selects that this
    matrix places, less those left out for a stated reason; nothing unproven."""
    cuda = platform_backend_names()
    placed = placed_backends() & cuda
    assert set(NOT_IN_PREFLIGHT) <= placed
    assert set(preflight.SUPPORTED_ATTENTION_BACKENDS["cuda"]) == placed - set(NOT_IN_PREFLIGHT)


def test_fp8_names_are_one_row_format() -> None:
    """Every fp8 ``--kv-cache-dtype`` name the preflight accepts on CUDA is vLLM's
    per-tensor fp8: the same quantization mode and one-byte elements as the ``fp8`` cells."""
    accepted = set(preflight.SUPPORTED_KV_CACHE_DTYPES["cuda"])
    assert accepted == {"auto", "float16", "bfloat16", *FP8_NAMES}
    for name in FP8_NAMES:
        assert get_kv_quant_mode(name) is KVQuantMode.FP8_PER_TENSOR
        assert STR_DTYPE_TO_TORCH_DTYPE[name] is torch.uint8
