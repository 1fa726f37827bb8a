"""Worker-side hooks for vLLM 0.32 on the CPU backend.

* ``CPUWorker.determine_available_memory`` answers the virtual capacity, so vLLM sizes its
  block table large without any of it being committed (and without reading free memory).
* ``CPUModelRunner.initialize_kv_cache`` marks the persistent (non-profiling) allocation;
  profiling / temporary caches keep vLLM's own allocation.
* ``CPUModelRunner.initialize_kv_cache_tensors`` validates our geometry *before* memory is
  touched, passes vLLM's ``kv_cache_allocation_context`` a mode that answers its one
  ``torch.zeros(n, int8)`` with the elastic backing, lets vLLM build its views, and then
  verifies every view against the geometry.
* ``CPUModelRunner.execute_model``, only with ``ELASTICKV_CHECK_COMMITS=1``: proves that
  the forward touched only pages committed before it (:mod:`.commit_check`).
* ``CPUWorker.elastickv_export_kv_pool`` (added) tells the engine core where the pool is, so
  a scheduler in another process can commit the pages this worker writes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.commit_check import CommitCheck
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.geometry_v032 import (
    geometry_from_config,
    single_tensor,
    verify_views,
)
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

_PERSISTENT = "_elastickv_persistent_kv"
_POOL = "_elastickv_kv_pool"
_EXPORT = "_elastickv_kv_export"
_CHECK = "_elastickv_commit_check"


class BackingMode(TorchFunctionMode):
    """Answers exactly one ``torch.zeros(numel, dtype=int8)`` on the CPU with ``backing``."""

    def __init__(self, backing: torch.Tensor) -> None:
        super().__init__()
        self._backing = backing
        self.served = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.zeros and not self.served and self._is_kv_request(args, kwargs):
            self.served += 1
            return self._backing
        return func(*args, **kwargs)

    def _is_kv_request(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        size: Any = args[0] if len(args) == 1 else tuple(args)
        if isinstance(size, int):
            size = (size,)
        device = kwargs.get("device")
        return (
            kwargs.get("dtype") is torch.int8
            and tuple(size) == (self._backing.numel(),)
            and (device is None or torch.device(device).type == "cpu")
        )


def _plain_context(context: Any) -> None:
    if context is not None and not isinstance(context, contextlib.nullcontext):
        raise ElasticKVStartupError(
            f"vLLM asked to allocate the KV cache inside {type(context).__name__} (a KV "
            "connector memory pool?); elastickv cannot place the cache there"
        )


def install(config: ElasticConfig, policy_factory: PolicyFactory) -> None:

    def memory_wrapper(original: Callable[..., int]) -> Callable[..., int]:
        def determine_available_memory(self: Any) -> int:
            original(self)  # keeps vLLM's warm-up; its host-memory figure is not ours
            return config.resolved_virtual_capacity()

        return determine_available_memory

    def init_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_kv_cache(
            self: Any,
            kv_cache_config: Any,
            is_profiling: bool = False,
            kv_cache_allocation_context: Any = None,
        ) -> Any:
            if not is_profiling:
                _plain_context(kv_cache_allocation_context)
            setattr(self, _PERSISTENT, not is_profiling)
            try:
                return original(
                    self,
                    kv_cache_config,
                    is_profiling,
                    kv_cache_allocation_context=kv_cache_allocation_context,
                )
            finally:
                setattr(self, _PERSISTENT, False)

        return initialize_kv_cache

    def tensors_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_kv_cache_tensors(
            self: Any,
            kv_cache_config: Any,
            kernel_block_sizes: list[int],
            kv_cache_allocation_context: Any = None,
        ) -> Any:
            if not getattr(self, _PERSISTENT, False):
                return original(
                    self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context
                )
            tensor = single_tensor(kv_cache_config)
            group = _group_index(kv_cache_config, tensor.layers[0])
            layout = self.cache_config.get_resolved_kv_cache_layout().name
            geometry = geometry_from_config(kv_cache_config, layout, kernel_block_sizes[group])
            size = int(tensor.size)
            placed = _place(self, config, geometry, size, policy_factory)
            backing = placed.backing()
            mode = BackingMode(backing)
            views = original(self, kv_cache_config, kernel_block_sizes, mode)
            if mode.served != 1:
                raise ElasticKVStartupError(
                    "vLLM did not allocate its KV cache through torch.zeros(n, int8) inside "
                    "kv_cache_allocation_context; this vLLM build breaks the 0.32 contract"
                )
            verify_views(geometry, list(tensor.layers), views, backing)
            attach_placement(self, config, placed, geometry, size)
            return views

        return initialize_kv_cache_tensors

    install_runner_hooks(config, memory_wrapper, init_wrapper, tensors_wrapper)


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


def _place(
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
        return placed.vmm_range.pool.fd
    return placed.pool.fd


def _group_index(kv_cache_config: Any, layer_name: str) -> int:
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if layer_name in group.layer_names:
            return index
    raise ElasticKVStartupError(f"layer {layer_name!r} is in no KV cache group")
