"""Worker-side machinery shared by both vLLM contracts (0.28 and 0.32) on the CPU backend.

Each contract's module (:mod:`.worker_v028`, :mod:`.worker_v032`) supplies only the three
wrappers that differ (available memory, the persistent-allocation mark, the KV tensor
placement); this module places the worker's own KV storage (:mod:`.worker_kv`), installs the
wrappers on vLLM's CPU classes, checks vLLM's views against the geometry
(:func:`verify_views`), maps the pages each step was granted before it runs, and adds the two
RPCs the engine core calls: the export (where the cache is, its geometry) and the page
operations of an engine going idle.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from elastickv.geometry import KVCacheGeometry, layer_views
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.hooks import wrap_method
from elastickv.integrations.vllm.kv_export import APPLY_METHOD, EXPORT_METHOD, PAGE_OPS_ATTR
from elastickv.integrations.vllm.worker.commit_check import CommitCheck
from elastickv.integrations.vllm.worker.worker_kv import PageMapError, WorkerKV
from elastickv.vmm.grants import PageOps

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
PERSISTENT_MARK = "_elastickv_persistent_kv"
_KV = "_elastickv_kv"
_CHECK = "_elastickv_commit_check"


def attach_placement(runner: Any, config: ElasticConfig, kv: WorkerKV) -> None:
    """Keep the placed storage with the runner: the export RPC, each step's page operations
    and the optional commit check find it there."""
    setattr(runner, _KV, kv)
    if config.check_commits and kv.fd >= 0:
        setattr(runner, _CHECK, CommitCheck(kv.fd))


def runner_kv(runner: Any) -> WorkerKV | None:
    """The elastic KV storage of a model runner (None for a native one)."""
    kv: WorkerKV | None = getattr(runner, _KV, None)
    return kv


def install_runner_hooks(
    config: ElasticConfig,
    memory_wrapper: Callable[..., Any],
    init_wrapper: Callable[..., Any],
    tensors_wrapper: Callable[..., Any],
) -> None:
    """Wrap the CPU worker and model runner (the same classes in both contracts) with one
    contract's hooks, plus what they share: each step's page operations mapped before it
    runs (and the optional commit check), the export and the idle page-operations RPCs."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    def execute_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            kv: WorkerKV | None = getattr(self, _KV, None)
            if kv is None:
                return original(self, scheduler_output, *args, **kwargs)
            ops = getattr(scheduler_output, PAGE_OPS_ATTR, None)
            try:
                kv.apply(ops)
            except PageMapError as exc:
                stop_engine(self, exc)
                raise
            check: CommitCheck | None = getattr(self, _CHECK, None)
            try:
                if check is None:
                    return original(self, scheduler_output, *args, **kwargs)
                return check.run(lambda: original(self, scheduler_output, *args, **kwargs))
            finally:
                kv.follower.step_queued()

        return execute_model

    def export_kv_pool(self: Any) -> dict[str, Any] | None:
        """RPC for the engine core: where this worker's KV cache is (None if not elastic)."""
        kv = runner_kv(self.model_runner)
        return None if kv is None else kv.export().to_wire()

    def apply_page_ops(self: Any, ops: PageOps | None) -> int:
        """RPC for the engine core going idle: apply ``ops`` and release every page held;
        returns the pages this worker holds committed now."""
        kv = runner_kv(self.model_runner)
        if kv is None:
            return 0
        try:
            kv.apply(ops)
            kv.settle()
        except PageMapError as exc:
            stop_engine(self.model_runner, exc)
            raise
        return kv.vmm_range.num_committed

    for name, method in ((EXPORT_METHOD, export_kv_pool), (APPLY_METHOD, apply_page_ops)):
        if not hasattr(CPUWorker, name):
            setattr(CPUWorker, name, method)
    wrap_method(CPUWorker, "determine_available_memory", memory_wrapper)
    wrap_method(CPUModelRunner, "initialize_kv_cache", init_wrapper)
    wrap_method(CPUModelRunner, "initialize_kv_cache_tensors", tensors_wrapper)
    wrap_method(CPUModelRunner, "execute_model", execute_wrapper)


def stop_engine(runner: Any, error: PageMapError) -> None:
    """A worker could not map what was granted. Rank 0 (or a worker in the engine core's own
    process) raises it to the engine core, which fails the engine with this message; any other
    rank exits at once, so that no rank waits forever in a collective for it: vLLM's executor
    sees the worker die and stops the engine."""
    logger.error("elastickv: %s", error)
    backend = getattr(runner.vllm_config.parallel_config, "distributed_executor_backend", None)
    if backend == "uni":
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        logging.shutdown()
        os._exit(1)


def place(runner: Any, config: ElasticConfig, geometry: KVCacheGeometry, size: int) -> WorkerKV:
    """This worker's own KV storage on its device, nothing committed; the engine core grants
    its pages step by step (see :mod:`.worker_kv`)."""
    import torch

    return WorkerKV.create(config, geometry, size, torch.device(runner.device))


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
