"""What the runner contract tests of both vLLM versions share (no vLLM import here).

vLLM's GPU model runners allocate the KV cache with ``torch.zeros(n, int8, device=cuda)``
and build every view on the tensor they get back; nothing else in that code touches the
device. So the runners' own allocation and view code runs on this CPU machine with
``device=cuda:0`` when a ``TorchFunctionMode`` answers that one call: natively with a plain
CPU tensor (:class:`NativeZeros`, what the GPU would give: zeros of that size), elastically
with the plugin's own mode over a host range.

Views are compared by address arithmetic (shape, stride, offset and element size relative to
each backing's start), so the elastic range's uncommitted pages are never touched; nor may a
failure report print a tensor over that range (pytest shows the arguments of every frame):
checks on an elastic placement run under :func:`without_locals`.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch.overrides import TorchFunctionMode

from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.worker import worker

CUDA = torch.device("cuda:0")
NUM_LAYERS = 2
# Blocks per cache: a few dozen, fewer for large pages (MLA, 256-token blocks).
MAX_BLOCKS = 32
MAX_CACHE_BYTES = 1 << 20
PAGE_SIZE = 64 << 10
RUNNERS = ("V1", "V2")
T = TypeVar("T")


@dataclass(frozen=True)
class DtypeCell:
    """One ``--dtype`` / ``--kv-cache-dtype`` pair of the matrix."""

    name: str
    model_dtype: torch.dtype
    kv_cache_dtype: str


DTYPE_CELLS = (
    DtypeCell("fp16", torch.float16, "auto"),
    DtypeCell("bf16", torch.bfloat16, "auto"),
    DtypeCell("fp8", torch.bfloat16, "fp8"),
)
# Row formats of a backend's own that the geometry does not describe: refused when offered.
OWN_ROW_FORMATS = ("fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4")


def dtype_cells(backend: Any, own_formats: bool = True) -> list[DtypeCell]:
    """The matrix's dtype cells the backend declares it serves (fp8: where it supports it;
    a model dtype it does not take is replaced by one it does), and with ``own_formats`` a
    cell for each of its own row formats."""
    model_dtypes = list(getattr(backend, "supported_dtypes", []) or [torch.float16])
    kv_dtypes = set(getattr(backend, "supported_kv_cache_dtypes", []) or ["auto"])
    cells = []
    for cell in DTYPE_CELLS:
        if cell.kv_cache_dtype == "auto":
            name = str(cell.model_dtype).removeprefix("torch.")
            if cell.model_dtype in model_dtypes and ({"auto", name} & kv_dtypes):
                cells.append(cell)
        elif cell.kv_cache_dtype in kv_dtypes:
            model = cell.model_dtype if cell.model_dtype in model_dtypes else model_dtypes[0]
            cells.append(DtypeCell(cell.name, model, cell.kv_cache_dtype))
    for own in OWN_ROW_FORMATS if own_formats else ():
        if own in kv_dtypes:
            cells.append(DtypeCell(own, model_dtypes[0], own))
    return cells


def num_blocks_for(page_bytes: int) -> int:
    return max(4, min(MAX_BLOCKS, MAX_CACHE_BYTES // (NUM_LAYERS * page_bytes)))


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


class NativeZeros(TorchFunctionMode):
    """vLLM's allocation as a GPU would answer it: ``torch.zeros`` on a ``cuda`` device gets
    a zeroed CPU tensor of that size (every other call runs unchanged)."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[torch.Tensor] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if func is torch.zeros and device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
            buffer = func(*args, **kwargs)
            self.buffers.append(buffer)
            return buffer
        return func(*args, **kwargs)


class StandInLayer:
    """An attention layer of the forward context: keeps the view vLLM binds to it (the real
    layer's binding is exercised by the engine tests on the CPU backend)."""

    def __init__(self) -> None:
        self.kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache


def forward_context() -> dict[str, Any]:
    return {name: StandInLayer() for name in layer_names()}


def elastic_config() -> ElasticConfig:
    return ElasticConfig(page_size=PAGE_SIZE)


@dataclass(frozen=True)
class Placed:
    """One run of a runner's allocation: the views it returned, those it bound to the layers
    and those it listed, and where each layer's backing lies in the geometry's one flat
    backing (``bases[name]``: the address of the layer's backing; ``starts[name]``: that
    backing's offset in the flat one)."""

    views: dict[str, torch.Tensor]
    bound: dict[str, torch.Tensor]
    runner_list: list[torch.Tensor]
    bases: dict[str, int]
    starts: dict[str, int]

    def offset(self, name: str, view: torch.Tensor) -> int:
        """Byte offset of ``view``'s first element in the flat backing."""
        return view.data_ptr() - self.bases[name] + self.starts[name]


def bound_views(context: dict[str, Any]) -> dict[str, torch.Tensor]:
    bound = {name: layer.kv_cache for name, layer in context.items()}
    assert all(view is not None for view in bound.values()), "a layer got no KV cache"
    return {name: view for name, view in bound.items() if view is not None}


def assert_same_views(native: Placed, elastic: Placed) -> None:
    """The two runs built the same views: the same shape, stride and dtype, starting at the
    same byte of the flat backing; returned, bound to the layers, listed by the runner (in
    layer order)."""
    names = layer_names()
    assert native.views.keys() == elastic.views.keys() == set(names)
    pairs = [(native.views, elastic.views), (native.bound, elastic.bound)]
    assert len(native.runner_list) == len(elastic.runner_list)
    if native.runner_list:
        listed = [dict(zip(names, run.runner_list, strict=True)) for run in (native, elastic)]
        pairs.append((listed[0], listed[1]))
    for theirs, ours in pairs:
        for name in theirs:
            view, want = ours[name], theirs[name]
            got_facts = (tuple(view.shape), view.stride(), view.dtype, elastic.offset(name, view))
            want_facts = (tuple(want.shape), want.stride(), want.dtype, native.offset(name, want))
            if got_facts != want_facts:
                raise AssertionError(f"{name}: elastic {got_facts} != native {want_facts}")


def extent(view: torch.Tensor, base: int) -> tuple[int, int]:
    """``[first, end)`` bytes from ``base`` that ``view`` spans (address arithmetic only)."""
    first = view.data_ptr() - base
    assert all(stride > 0 for stride in view.stride())
    last = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True))
    return first, first + (last + 1) * view.element_size()


def assert_on_range(elastic: Placed, backing: torch.Tensor) -> None:
    """Every elastic view (returned, bound, listed) is on the elastic range, inside it."""
    storage = backing.untyped_storage().data_ptr()
    for view in (*elastic.views.values(), *elastic.bound.values(), *elastic.runner_list):
        assert view.untyped_storage().data_ptr() == storage
        first, end = extent(view, backing.data_ptr())
        assert first >= 0 and end <= backing.numel()


def assert_block_bytes(geometry: KVCacheGeometry, placed: Placed) -> None:
    """Every block of every layer covers, in vLLM's view, exactly the bytes the geometry
    gives it (``block_byte_ranges``: the pages elastickv commits for it). Read from the
    views' shape, stride and offset over a map of the flat backing's bytes (the views' own
    memory is never touched)."""
    ratio, blocks = geometry.kernel_ratio, geometry.num_blocks
    # The (layer, block) owning each byte, as vLLM's views address it and as the geometry says.
    owner = torch.full((geometry.backing_bytes,), -1, dtype=torch.int16)
    expected = torch.full((geometry.backing_bytes,), -1, dtype=torch.int16)
    for layer, name in enumerate(layer_names()):
        view = placed.views[name]
        assert view.shape[0] == blocks * ratio
        esize = view.element_size()
        as_bytes = torch.as_strided(
            owner,
            (*view.shape, esize),
            (*(stride * esize for stride in view.stride()), 1),
            placed.offset(name, view),
        )
        for block in range(blocks):
            as_bytes[block * ratio : (block + 1) * ratio].fill_(layer * blocks + block)
            for start, end in geometry.block_byte_ranges(block, layer):
                expected[start:end] = layer * blocks + block
    assert torch.equal(owner, expected)


def without_locals(call: Callable[[], T]) -> T:
    """``call()``; a failure is reported with its traceback as text. pytest would show the
    arguments of every frame, tensors over an elastic range included, and the placement
    closes its range when it fails: reading those tensors would be a segfault."""
    try:
        return call()
    except Exception as exc:
        pytest.fail("".join(traceback.format_exception(exc)), pytrace=False)


def close_placement(runner: Any) -> None:
    kv = worker.runner_kv(runner)
    if kv is not None:
        kv.vmm_range.close()


@contextmanager
def refused_before_memory(module: Any, match: str) -> Iterator[None]:
    """The placement must refuse with an ``ElasticKVStartupError`` matching ``match`` before
    it reserves any memory (``module.place`` is never called)."""
    mp = pytest.MonkeyPatch()

    def no_place(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("elastickv reserved memory for a KV cache it refuses")

    mp.setattr(module, "place", no_place)
    try:
        with pytest.raises(ElasticKVStartupError, match=match):
            yield
    finally:
        mp.undo()


def platform_backend_names() -> set[str]:
    """The attention backends vLLM's CUDA platform selects from, read from the installed
    vLLM's ``platforms/cuda.py`` (which does not import without CUDA)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm.platforms")
    assert spec is not None and spec.submodule_search_locations is not None
    source = Path(next(iter(spec.submodule_search_locations)), "cuda.py").read_text()
    return set(re.findall(r"AttentionBackendEnum\.(\w+)", source))
