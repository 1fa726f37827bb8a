"""Contract: vLLM 0.28's own model runners place their KV cache on elastickv's storage exactly
as they place it natively, for both runners and every attention backend that imports here.

Runners: Model Runner V1 (``GPUModelRunner.initialize_kv_cache_tensors``: one
``torch.zeros(size, int8)`` per layer, then ``_reshape_kv_cache_tensors`` with the backend's
``get_kv_cache_shape`` / ``get_kv_cache_stride_order``, then ``bind_kv_cache``; called on a
runner built without ``__init__`` that holds only what it reads) and Model Runner V2 (the
module-level ``init_kv_cache``). Both run with ``device=cuda:0`` on this CPU machine (see
``runner_contract``): natively each per-layer ``torch.zeros`` is a plain CPU tensor;
elastically the plugin's own placement (``worker_v028.place_per_layer`` with its
``LayerBackingMode``) answers them, in order, with consecutive slices of one host range
(``memory_device="cpu"``) and checks every view against the geometry.

vLLM side, its own code: the layer's spec as ``Attention`` / ``MLAAttention`` publish it,
prepared as ``gpu/attn_utils.get_kv_cache_spec`` does (``indexes_kv_by_block_stride``, the
backend's ``customize_spec``), the ``KVCacheConfig`` from ``get_kv_cache_config_from_groups``,
the kernel block sizes from ``prepare_kernel_block_sizes``; NHD/HND the way 0.28 selects it
(``VLLM_KV_CACHE_LAYOUT``, read by the backends' stride orders).

Matrix: every ``AttentionBackendEnum`` member (skipped with its import error when it does not
import here) × each NHD/HND setting that gives the backend a different stride order × fp16 /
bf16 / fp8 where it serves them (plus its own row formats) × V1 / V2, and a block of two
kernel blocks for backends with fixed kernel block sizes. Per layer: the same shape, stride,
offset (relative to the layer's own backing, which elastickv puts at ``layer × layer bytes``
of its range) and dtype natively and elastically, for the views returned, bound to the layers
and listed by the runner; the elastic ones on the elastic range; every block's bytes exactly
the geometry's ``block_byte_ranges``. Backends elastickv does not place under 0.28 are
refused by name before any memory is reserved (``REFUSED`` says why, each).
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
from vllm.v1.attention.backends.utils import get_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    get_kv_quant_mode,
)
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu import model_runner as v2_model_runner
from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes
from vllm_backends import load_backends

from elastickv.integrations.vllm import preflight
from elastickv.integrations.vllm.worker import geometry_v028, worker, worker_v028

pytestmark = pytest.mark.vllm

ENVS = ("NHD", "HND")
_SPLIT = "K and V as separate planes, a shape the 0.28 placement does not take"
_SPARSE = "sparse MLA: its models also keep the indexer's cache"
_ROCM = "a ROCm backend: elastickv has no ROCm memory backend"
_MINIMAX = "MiniMax-M3 sparse attention: its models keep more than one cache"
# Importable backends the 0.28 placement refuses by name, and why.
REFUSED = {
    "ROCM_ATTN": f"(2, B, N, H, D): {_SPLIT}",
    "HPC_ATTN": f"(B, 2, N, H, D): {_SPLIT}",
    "TURBOQUANT": "TurboQuant's own rows, which the geometry does not describe",
    "FLASHINFER_MLA_SPARSE_SM120": "656-byte fp8_ds_mla rows, even for auto",
    "ROCM_AITER_FA": _ROCM,
    "ROCM_AITER_UNIFIED_ATTN": _ROCM,
    "ROCM_AITER_MLA": _ROCM,
    "ROCM_AITER_TRITON_MLA": _ROCM,
    "ROCM_AITER_MLA_SPARSE": _ROCM,
    "XPU_MLA_SPARSE": "an XPU backend: elastickv has no XPU memory backend",
    "CPU_MLA": "MLA on vLLM's CPU platform is not tested end to end",
    "FLASHMLA_SPARSE": _SPARSE,
    "FLASH_ATTN_MLA_SPARSE": _SPARSE,
    "FLASHINFER_MLA_SPARSE": _SPARSE,
    "FLASHMLA_SPARSE_DSV4": _SPARSE,
    "FLASHINFER_MLA_SPARSE_DSV4": _SPARSE,
    "CUTLASS_MSA": _MINIMAX,
    "TRITON_MSA": _MINIMAX,
    # Imports only after a first import of vllm.models.minimax_m3 failed (on torchvision):
    # when test_contract_v028.py ran first in this process.
    "MINIMAX_M3_SPARSE": _MINIMAX,
}
# Rows the geometry cannot describe: refused by the shape or row check too, whatever the name.
NOT_MODELLED = {
    "ROCM_ATTN": ("auto", "is not the packed"),
    "HPC_ATTN": ("auto", "is not the packed"),
    "FLASHINFER_MLA_SPARSE_SM120": ("fp8_ds_mla", "does not support KV quantization mode"),
    "TURBOQUANT": ("turboquant_k8v4", "does not support KV quantization mode"),
}
# Backends whose rows are their own format only: the matrix offers them that one (TurboQuant
# serves no other; SM120's 0.28 shape is fp8_ds_mla's whatever the spec says).
ONLY_ROW_FORMAT = {"FLASHINFER_MLA_SPARSE_SM120": "fp8_ds_mla", "TURBOQUANT": "turboquant_k8v4"}


BACKENDS, IMPORT_ERRORS = load_backends(AttentionBackendEnum)


@contextmanager
def kv_cache_layout(name: str) -> Iterator[None]:
    """Select NHD/HND the way vLLM 0.28 does: ``VLLM_KV_CACHE_LAYOUT``."""
    old = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    os.environ["VLLM_KV_CACHE_LAYOUT"] = name
    get_kv_cache_layout.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ["VLLM_KV_CACHE_LAYOUT"]
        else:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = old
        get_kv_cache_layout.cache_clear()


def stride_order(backend: Any) -> tuple[int, ...] | None:
    try:
        return tuple(backend.get_kv_cache_stride_order())
    except (AttributeError, NotImplementedError):
        return None


def envs(backend: Any) -> list[str]:
    """The NHD/HND settings that give the backend different stride orders."""
    found: dict[tuple[int, ...] | None, str] = {}
    for env in ENVS:
        with kv_cache_layout(env):
            found.setdefault(stride_order(backend), env)
    return list(found.values())


def natural_block_size(backend: Any) -> int:
    sizes = backend.get_supported_kernel_block_sizes()
    if any(isinstance(s, MultipleOf) and 16 % s.base == 0 for s in sizes):
        return 16
    candidates = [-(-16 // s.base) * s.base if isinstance(s, MultipleOf) else int(s) for s in sizes]
    return int(min((s for s in candidates if s >= 16), default=max(candidates)))


def has_fixed_kernel_blocks(backend: Any) -> bool:
    return not any(isinstance(s, MultipleOf) for s in backend.get_supported_kernel_block_sizes())


def head_size(backend: Any, mla: bool) -> int:
    declared = list(backend.get_supported_head_sizes())
    preferred = 576 if mla else 64
    if not declared or preferred in declared:
        return preferred
    return int(min(declared))


@dataclass(frozen=True)
class Case:
    backend: str
    env: str
    cell: DtypeCell
    runner: str
    split: bool = False  # blocks of two of the backend's largest kernel blocks

    @property
    def block_size(self) -> int:
        backend = BACKENDS[self.backend]
        if self.split:
            return 2 * max(int(s) for s in backend.get_supported_kernel_block_sizes())
        return natural_block_size(backend)

    @property
    def expected_refusal(self) -> str | None:
        if self.backend in REFUSED:
            return f"does not support the {self.backend} attention backend with vLLM 0.28"
        if self.cell.kv_cache_dtype in OWN_ROW_FORMATS:
            return "does not support KV quantization mode"
        return None


def layer_spec(case: Case, backend: Any) -> Any:
    """The spec as ``gpu/attn_utils.get_kv_cache_spec`` prepares it for the backend."""
    kv = case.cell.kv_cache_dtype
    dtype = case.cell.model_dtype if kv == "auto" else STR_DTYPE_TO_TORCH_DTYPE[kv]
    mla = backend.is_mla()
    size = head_size(backend, mla)
    if mla:
        spec: Any = MLAAttentionSpec(
            block_size=case.block_size,
            num_kv_heads=1,
            head_size=size,
            dtype=dtype,
            cache_dtype_str=kv,
            kv_quant_mode=get_kv_quant_mode(kv),
            state_content_bytes=656 if kv == "fp8_ds_mla" else None,
        )
    else:
        spec = FullAttentionSpec(
            block_size=case.block_size,
            num_kv_heads=4,
            head_size=size,
            head_size_v=head_size_v(case, size),
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(kv),
        )
    spec = replace(spec, indexes_kv_by_block_stride=backend.indexes_kv_by_block_stride())
    return backend.customize_spec(spec)


def head_size_v(case: Case, size: int) -> int:
    return size // 2 if case.backend.endswith("DIFFKV") else size


@contextmanager
def backend_state(case: Case) -> Iterator[None]:
    """The layout setting, and a DiffKV backend's V head size (a class attribute its layers
    set), for the duration of one case."""
    backend = BACKENDS[case.backend]
    with kv_cache_layout(case.env):
        if not case.backend.endswith("DIFFKV"):
            yield
            return
        old = backend.head_size_v
        backend.set_head_size_v(head_size_v(case, head_size(backend, False)))
        try:
            yield
        finally:
            backend.set_head_size_v(old)


@dataclass
class Setup:
    kv_cache_config: Any
    attn_groups: list[list[Any]]
    kernel_block_sizes: list[int]
    cache_config: Any


def setup(case: Case) -> Setup:
    backend = BACKENDS[case.backend]
    spec = layer_spec(case, backend)
    cache_config = types.SimpleNamespace(
        num_gpu_blocks_override=num_blocks_for(spec.page_size_bytes),
        cache_dtype=case.cell.kv_cache_dtype,
    )
    vllm_config = types.SimpleNamespace(cache_config=cache_config, kv_transfer_config=None)
    group = KVCacheGroupSpec(layer_names(), spec)
    config = get_kv_cache_config_from_groups(vllm_config, [group], available_memory=1 << 40)
    attn_groups = [[AttentionGroup(backend, layer_names(), spec, 0)]]
    return Setup(config, attn_groups, prepare_kernel_block_sizes(config, attn_groups), cache_config)


def original(function: Any) -> Any:
    return getattr(function, "__elastickv_original__", function)


def v1_runner(s: Setup) -> Any:
    """A V1 runner holding what ``initialize_kv_cache_tensors`` reads."""
    runner = gpu_model_runner.GPUModelRunner.__new__(gpu_model_runner.GPUModelRunner)
    runner.device = CUDA
    runner.cache_config = s.cache_config
    runner.kv_cache_config = s.kv_cache_config
    runner.shared_kv_cache_layers = {}
    runner.runner_only_attn_layers = set()
    runner.model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="llama"))
    runner.attn_groups = s.attn_groups
    runner.compilation_config = types.SimpleNamespace(static_forward_context=forward_context())
    runner.kv_caches = []
    return runner


def run(case: Case, s: Setup, elastic: bool) -> tuple[Placed, Any]:
    """One allocation by the case's runner: native (under :class:`NativeZeros`) or through
    the plugin's placement; returns what it built and the runner."""
    listed: list[torch.Tensor] = []
    if case.runner == "V1":
        runner = v1_runner(s)
        tensors = original(gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors)
        context = runner.compilation_config.static_forward_context
        listed = runner.kv_caches

        def allocate(mode: Any) -> dict[str, torch.Tensor]:
            views: dict[str, torch.Tensor] = tensors(
                runner, s.kv_cache_config, s.kernel_block_sizes
            )
            return views

    else:
        runner = v2_model_runner.GPUModelRunner.__new__(v2_model_runner.GPUModelRunner)
        context = forward_context()
        vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="x")),
            compilation_config=types.SimpleNamespace(static_forward_context=context),
        )
        init_kv_cache = original(v2_model_runner.init_kv_cache)

        def allocate(mode: Any) -> dict[str, torch.Tensor]:
            views: dict[str, torch.Tensor] = init_kv_cache(
                listed,
                context,
                s.kv_cache_config,
                s.attn_groups,
                CUDA,
                case.cell.kv_cache_dtype,
                s.kernel_block_sizes,
                vllm_config,
            )
            return views

    layer_bytes = int(s.kv_cache_config.kv_cache_tensors[0].size)
    if elastic:
        views = worker_v028.place_per_layer(
            elastic_config(),
            runner,
            s.kv_cache_config,
            s.attn_groups,
            s.kernel_block_sizes,
            CUDA,
            allocate,
            memory_device="cpu",
        )
        kv = worker.runner_kv(runner)
        assert kv is not None
        bases = dict.fromkeys(layer_names(), kv.backing().data_ptr())
        starts = dict.fromkeys(layer_names(), 0)
    else:
        native = NativeZeros()
        with native:
            views = allocate(None)
        assert len(native.buffers) == len(layer_names())
        bases = {n: b.data_ptr() for n, b in zip(layer_names(), native.buffers, strict=True)}
        starts = {name: layer * layer_bytes for layer, name in enumerate(layer_names())}
    return Placed(views, bound_views(context), list(listed), bases, starts), runner


def check(case: Case) -> None:
    with backend_state(case):
        s = setup(case)
        native, _ = run(case, s, elastic=False)
        expected = case.expected_refusal
        if expected is not None:
            with refused_before_memory(worker_v028, expected):
                run(case, s, elastic=True)
            return
        without_locals(lambda: check_placed(case, s, native))


def check_placed(case: Case, s: Setup, native: Placed) -> None:
    """The elastic run of a case whose cache elastickv places, against the native one."""
    elastic, runner = run(case, s, elastic=True)
    try:
        kv = worker.runner_kv(runner)
        assert kv is not None
        tensors = s.kv_cache_config.kv_cache_tensors
        assert kv.size_bytes == sum(int(t.size) for t in tensors) >= kv.geometry.backing_bytes
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
        cells = dtype_cells(backend, own_formats=False)
        if name in ONLY_ROW_FORMAT:
            own = ONLY_ROW_FORMAT[name]
            cells = [DtypeCell(own, backend.supported_dtypes[0], own)]
        for env in envs(backend):
            for cell in cells:
                for runner in RUNNERS:
                    case = Case(name, env, cell, runner)
                    params.append(pytest.param(case, id=f"{runner}-{name}-{env}-{cell.name}"))
        if has_fixed_kernel_blocks(backend):
            for runner in RUNNERS:
                case = Case(name, envs(backend)[0], cells[0], runner, split=True)
                params.append(
                    pytest.param(case, id=f"{runner}-{name}-{case.env}-{cells[0].name}-split")
                )
    return params


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


def placed_backends() -> set[str]:
    plain = [c for c in matrix() if c.cell.kv_cache_dtype not in OWN_ROW_FORMATS]
    names = {c.backend for c in plain}
    return {n for n in names if all(c.expected_refusal is None for c in plain if c.backend == n)}


def test_supported_backends_are_exactly_those_placed() -> None:
    """The 0.28 allowlist names exactly the backends this matrix places (an unproven name,
    one that does not import here, cannot be in it), and every other importable one has its
    reason in ``REFUSED``."""
    placed = placed_backends()
    assert set(geometry_v028.SUPPORTED_BACKENDS) == placed
    assert set(BACKENDS) - placed <= set(REFUSED) and not set(REFUSED) & placed


def test_preflight_offers_the_placed_cuda_backends() -> None:
    """``--attention-backend`` on CUDA, where the backend exists in 0.28: exactly the
    backends vLLM's CUDA platform selects that this matrix places."""
    cuda = platform_backend_names()
    offered = set(preflight.SUPPORTED_ATTENTION_BACKENDS["cuda"]) & set(
        AttentionBackendEnum.__members__
    )
    assert offered == placed_backends() & cuda
    assert set(preflight.SUPPORTED_ATTENTION_BACKENDS["cpu"]) <= placed_backends()


@pytest.mark.parametrize("name", sorted(NOT_MODELLED))
def test_shapes_the_geometry_does_not_describe_are_refused_by_shape(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the name check out of the way, the shape check still refuses what the geometry
    does not describe, before any memory is reserved."""
    if name not in BACKENDS:
        pytest.skip(f"{name} does not import here: {IMPORT_ERRORS[name]}")
    kv_cache_dtype, match = NOT_MODELLED[name]
    monkeypatch.setattr(geometry_v028, "SUPPORTED_BACKENDS", (name,))
    cell = DtypeCell(kv_cache_dtype, torch.bfloat16, kv_cache_dtype)
    case = Case(name, "NHD", cell, "V1")
    with backend_state(case):
        s = setup(case)
        run(case, s, elastic=False)
        with refused_before_memory(worker_v028, match):
            run(case, s, elastic=True)
