"""Worker-side machinery shared by both vLLM contracts (0.28 and 0.32) on the CPU backend.

Each contract's module (:mod:`.worker_v028`, :mod:`.worker_v032`) supplies only the three
wrappers that differ (available memory, the persistent-allocation mark, the KV tensor
placement); this module places the pool (in-process store or a pool the engine core attaches
to), publishes it, installs the wrappers on vLLM's CPU classes, checks vLLM's views against
the geometry (:func:`verify_views`), and adds the export RPC and the optional commit check.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from elastickv.geometry import KVCacheGeometry, layer_views
from elastickv.integrations.vllm.commit_check import CommitCheck
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.hooks import wrap_method
from elastickv.integrations.vllm.registration import describe_engine
from elastickv.integrations.vllm.shared_pool import (
    EXPORT_METHOD,
    IN_PROCESS,
    PoolExport,
    WorkerPool,
    geometry_to_wire,
)
from elastickv.integrations.vllm.store import REGISTRY, ElasticStore, PolicyFactory
from elastickv.vmm import HostRange

if TYPE_CHECKING:
    import torch

PERSISTENT_MARK = "_elastickv_persistent_kv"
_POOL = "_elastickv_kv_pool"
_EXPORT = "_elastickv_kv_export"
_CHECK = "_elastickv_commit_check"


def attach_placement(
    runner: Any,
    config: ElasticConfig,
    placed: ElasticStore | WorkerPool,
    geometry: KVCacheGeometry,
    size: int,
) -> None:
    """Hand the placed pool to the scheduler: in-process through the registry, across processes
    as the export the engine core fetches by RPC. Shared by both vLLM contracts."""
    if isinstance(placed, ElasticStore):
        REGISTRY.publish(placed)
        export = PoolExport(
            pid=os.getpid(),
            fd=export_fd(placed),
            size_bytes=size,
            page_size=config.page_size,
            mapping=IN_PROCESS,
            geometry=geometry_to_wire(geometry),
        )
    else:
        export = placed.export(geometry)
    setattr(runner, _POOL, placed)  # keeps the pool (and its fd) alive with the runner
    setattr(runner, _EXPORT, export)
    if config.check_commits:
        setattr(runner, _CHECK, CommitCheck(export_fd(placed)))


def install_runner_hooks(
    config: ElasticConfig,
    memory_wrapper: Callable[..., Any],
    init_wrapper: Callable[..., Any],
    tensors_wrapper: Callable[..., Any],
) -> None:
    """Wrap the CPU worker and model runner (the same classes in both contracts) with one
    contract's hooks, plus the export RPC and the optional commit check they share."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    def execute_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            check: CommitCheck | None = getattr(self, _CHECK, None)
            if check is None:
                return original(self, scheduler_output, *args, **kwargs)
            return check.run(lambda: original(self, scheduler_output, *args, **kwargs))

        return execute_model

    def export_kv_pool(self: Any) -> dict[str, Any] | None:
        """RPC for the engine core: where this worker's KV pool is (None if not elastic)."""
        export: PoolExport | None = getattr(self.model_runner, _EXPORT, None)
        return None if export is None else export.to_wire()

    if not hasattr(CPUWorker, EXPORT_METHOD):
        setattr(CPUWorker, EXPORT_METHOD, export_kv_pool)
    wrap_method(CPUWorker, "determine_available_memory", memory_wrapper)
    wrap_method(CPUModelRunner, "initialize_kv_cache", init_wrapper)
    wrap_method(CPUModelRunner, "initialize_kv_cache_tensors", tensors_wrapper)
    if config.check_commits:
        wrap_method(CPUModelRunner, "execute_model", execute_wrapper)


def place(
    runner: Any,
    config: ElasticConfig,
    geometry: KVCacheGeometry,
    size: int,
    policy_factory: PolicyFactory,
) -> ElasticStore | WorkerPool:
    """A strict range shared with the scheduler when it runs in this process (vLLM's ``uni``
    executor), else a pool the engine core attaches to (see :mod:`.shared_pool`)."""
    backend = runner.vllm_config.parallel_config.distributed_executor_backend
    if backend == "uni":
        describe_engine(runner.vllm_config)  # the scheduler is in this process: register here
        return ElasticStore.create(config, geometry, size, policy_factory)
    return WorkerPool.create(config, size)


def export_fd(placed: ElasticStore | WorkerPool) -> int:
    """The memfd behind the placed KV cache, in this process."""
    if isinstance(placed, ElasticStore):
        vmm_range = placed.vmm_range
        if not isinstance(vmm_range, HostRange):
            raise ElasticKVStartupError("internal: a worker's KV cache is not on a host range")
        return vmm_range.pool.fd
    return placed.pool.fd


def advertised_capacity(worker: Any, config: ElasticConfig) -> int:
    """The KV bytes to tell vLLM it has: the virtual capacity, but never more than the engine
    can use at once (``max_num_seqs`` requests of ``max_model_len`` tokens, plus the null
    block). vLLM builds one Python object per block at start-up, so blocks beyond that bound
    would only cost start-up time and memory (1 TiB of a tiny model: 32M blocks, 120 s).

    The block count is a multiple of :func:`page_aligned_blocks` (rounded up from the bound,
    down from the virtual capacity; not where that multiple exceeds the bound), so in a
    layer-major layout every layer starts on a page boundary. Otherwise pages straddle the
    blocks of two layers at different block indices: with a tiny model on 64 KiB pages,
    8 pages held 12 blocks where 15 fit."""
    virtual = config.resolved_virtual_capacity()
    try:
        specs = list(worker.model_runner.get_kv_cache_spec().values())
        vllm_config = worker.vllm_config
        max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        max_len = int(vllm_config.model_config.max_model_len)
        layer_bytes = [int(spec.page_size_bytes) for spec in specs]
        block_size = int(specs[0].block_size)
    except (AttributeError, IndexError, TypeError, ValueError):
        return virtual  # an unfamiliar runner: keep the configured capacity
    if block_size <= 0 or min(layer_bytes) <= 0:
        return virtual
    block_bytes = sum(layer_bytes)
    align = page_aligned_blocks(layer_bytes, config.page_size)
    usable = max_seqs * -(-max_len // block_size) + 1
    if align > usable:
        align = 1  # rounding up would more than double the blocks (a tiny model on big pages)
    usable += -usable % align
    fits = virtual // block_bytes
    if fits >= align:
        fits -= fits % align
    return min(fits, usable) * block_bytes


def page_aligned_blocks(layer_block_bytes: Iterable[int], page_size: int) -> int:
    """The fewest blocks whose bytes in every layer fill whole pages: a block count that is a
    multiple of it starts every layer of a layer-major layout on a page boundary."""
    align = 1
    for size in set(layer_block_bytes):
        align = math.lcm(align, page_size // math.gcd(page_size, size))
    return align


def group_index(kv_cache_config: Any, layer_name: str) -> int:
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if layer_name in group.layer_names:
            return index
    raise ElasticKVStartupError(f"layer {layer_name!r} is in no KV cache group")


def verify_views(
    geometry: KVCacheGeometry,
    layer_names: list[str],
    views: dict[str, torch.Tensor],
    backing: torch.Tensor,
) -> None:
    """Every layer's view must be exactly the geometry's (shape, stride, offset, dtype) and
    lie on ``backing``; otherwise start-up fails with the first difference."""
    if backing.storage_offset() != 0:
        raise ElasticKVStartupError("internal: the elastic backing must start at its storage")
    base = backing.untyped_storage().data_ptr()
    for name, expected in zip(layer_names, layer_views(geometry), strict=True):
        view = views.get(name)
        if view is None:
            raise ElasticKVStartupError(f"vLLM built no KV cache view for layer {name!r}")
        got = (tuple(view.shape), tuple(view.stride()), view.storage_offset(), view.dtype)
        want = (expected.shape, expected.stride, expected.storage_offset, expected.dtype)
        if got != want:
            raise ElasticKVStartupError(
                f"vLLM's KV cache view of layer {name!r} (shape, stride, offset, dtype) = "
                f"{got} differs from elastickv's geometry {want}; refusing to run"
            )
        if view.untyped_storage().data_ptr() != base:
            raise ElasticKVStartupError(f"layer {name!r}'s KV cache is not on elastickv storage")
