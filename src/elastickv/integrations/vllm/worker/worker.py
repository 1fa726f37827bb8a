"""Worker-side machinery shared by both vLLM contracts (0.28 and 0.32) and both model runners.

Each contract's module (:mod:`.worker_v028`, :mod:`.worker_v032`) supplies only what differs:
where vLLM allocates its KV tensors (one backing or one per layer) for Model Runner V1 and V2.
This module holds the rest. The hooks sit on vLLM's GPU classes, which the CPU ones inherit
from, so the CPU engines these tests run drive the same hooks a GPU engine does:

* the runners' ``initialize_kv_cache`` marks the persistent allocation (profiling and
  temporary caches keep vLLM's own memory);
* the runners' ``execute_model`` maps the pages the step was granted before it runs (a step
  vLLM runs without its scheduler, a warm-up, gets the pages of its blocks mapped by the
  worker itself); ``sample_tokens`` ends the step's queued work (a release waits for it);
* the workers' ``determine_available_memory`` answers the virtual capacity, and the GPU
  worker's start-up check of free memory lets an elastic engine start beside others;
* two RPCs for the engine core: the export (where the cache is, its geometry) and the page
  operations of an engine going idle; two more that release and reload the model's weights
  while the process stays up (:mod:`.weights_sleep`; on a GPU through vLLM's sleep mode,
  whose ``kv_cache`` memory pool the KV cache never enters: :mod:`.vllm_sleep`).

The placement itself (:func:`place`, :class:`BackingMode`, :class:`LayerBackingMode`,
:func:`verify_views`) answers vLLM's ``torch.zeros`` with a tensor over the worker's own
elastic range and checks every view vLLM built on it against the geometry.
"""

from __future__ import annotations

import contextvars
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode

from elastickv.geometry import KVCacheGeometry, layer_views
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.hooks import wrap_method
from elastickv.integrations.vllm.kv_export import APPLY_METHOD, EXPORT_METHOD, PAGE_OPS_ATTR
from elastickv.integrations.vllm.worker import vllm_sleep, weights_sleep
from elastickv.integrations.vllm.worker.capacity import advertised_capacity
from elastickv.integrations.vllm.worker.commit_check import CommitCheck
from elastickv.integrations.vllm.worker.worker_kv import (
    PageMapError,
    WorkerKV,
    scheduled_block_ids,
)
from elastickv.vmm.grants import PageOps

logger = logging.getLogger(__name__)
PERSISTENT_MARK = "_elastickv_persistent_kv"
_KV = "_elastickv_kv"
_CHECK = "_elastickv_commit_check"
_UNPLANNED = object()
# The V2 runner whose persistent KV cache is being initialised (its allocation function is
# a module-level function that does not receive the runner).
INITIALISING: contextvars.ContextVar[Any] = contextvars.ContextVar("elastickv_initialising")


class BackingMode(TorchFunctionMode):
    """Answers exactly one ``torch.zeros(numel, dtype=int8)`` on ``device`` (vLLM's KV
    cache) with ``backing``; every other call runs unchanged."""

    def __init__(self, backing: torch.Tensor, device: torch.device | str | None = None) -> None:
        super().__init__()
        self._backing = backing
        self._device = torch.device(device if device is not None else backing.device).type
        self.served = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.zeros and not self.served and self._is_kv(args, kwargs, self._backing):
            self.served += 1
            return self._backing
        return func(*args, **kwargs)

    def _is_kv(self, args: Sequence[Any], kwargs: Mapping[str, Any], target: torch.Tensor) -> bool:
        size: Any = args[0] if len(args) == 1 else tuple(args)
        if isinstance(size, int):
            size = (size,)
        device = kwargs.get("device")
        return (
            kwargs.get("dtype") is torch.int8
            and tuple(size) == (target.numel(),)
            and torch.device(device if device is not None else "cpu").type == self._device
        )


class LayerBackingMode(BackingMode):
    """Answers vLLM's per-layer ``torch.zeros(size, dtype=int8)`` calls on ``device``, in
    order, with ``slices`` (each exactly ``size`` bytes); every other call runs unchanged."""

    def __init__(self, slices: list[torch.Tensor], device: torch.device | str | None = None):
        super().__init__(slices[0], device)
        self._slices = slices

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.zeros and self.served < len(self._slices):
            target = self._slices[self.served]
            if self._is_kv(args, kwargs, target):
                self.served += 1
                return target
        return func(*args, **kwargs)


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


def place(
    config: ElasticConfig, geometry: KVCacheGeometry, size: int, device: torch.device | str
) -> WorkerKV:
    """This worker's own KV storage on its device, nothing committed but the null block; the
    engine core grants its pages step by step (see :mod:`.worker_kv`)."""
    return WorkerKV.create(config, geometry, size, torch.device(device))


def persistent_init_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """A runner's ``initialize_kv_cache``: the call that is not profiling places the KV cache
    on elastic storage (the mark, and the runner for a V2 allocation function); a KV cache
    allocation context vLLM passes (a KV connector's memory pool; sleep mode's is kept out by
    :func:`.vllm_sleep.pool_context_wrapper`) cannot be honoured and is refused."""

    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        profiling = bool(kwargs.get("is_profiling", args[0] if args else False))
        context = kwargs.get("kv_cache_allocation_context", args[1] if len(args) > 1 else None)
        if not profiling and context is not None and type(context).__name__ != "nullcontext":
            raise ElasticKVStartupError(
                f"vLLM asked to allocate the KV cache inside {type(context).__name__} (a KV "
                "connector's memory pool); elastickv cannot place the cache there"
            )
        setattr(self, PERSISTENT_MARK, not profiling)
        token = INITIALISING.set(self if not profiling else None)
        try:
            return original(self, kv_cache_config, *args, **kwargs)
        finally:
            INITIALISING.reset(token)
            setattr(self, PERSISTENT_MARK, False)

    return initialize_kv_cache


def execute_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """A runner's ``execute_model``: the step's granted pages first (a step without grants is
    one vLLM runs itself, a warm-up: the worker maps its blocks' pages), then the forward
    (under the commit check when asked), then the step's work marked as queued. A runner
    whose weights sleep is woken first (:mod:`.weights_sleep`)."""

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        weights_sleep.wake_if_asleep(self)
        kv: WorkerKV | None = getattr(self, _KV, None)
        if kv is None:
            return original(self, scheduler_output, *args, **kwargs)
        ops = getattr(scheduler_output, PAGE_OPS_ATTR, _UNPLANNED)
        try:
            if ops is _UNPLANNED:
                kv.map_unplanned(scheduled_block_ids(scheduler_output))
            else:
                kv.apply(cast(PageOps | None, ops))
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


def dummy_batch_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """A worker's ``execute_dummy_batch`` (a data-parallel rank with nothing to run steps with
    the others): a forward too, so a sleeping runner is woken first."""

    def execute_dummy_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        weights_sleep.wake_if_asleep(self.model_runner)
        return original(self, *args, **kwargs)

    return execute_dummy_batch


def sample_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """A runner's ``sample_tokens``: the step's sampling and drafting are queued work too."""

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            kv: WorkerKV | None = getattr(self, _KV, None)
            if kv is not None:
                kv.follower.step_queued()

    return sample_tokens


def request_memory_wrapper(original: Callable[..., int]) -> Callable[..., int]:
    """vLLM's start-up check that ``--gpu-memory-utilization`` of the device is free fails an
    engine started beside others; an elastic engine's KV cache is committed on demand under
    the ledger's budget, so only its weights and activations need free memory now."""

    def request_memory(init_snapshot: Any, cache_config: Any, *args: Any, **kwargs: Any) -> int:
        try:
            return original(init_snapshot, cache_config, *args, **kwargs)
        except ValueError as exc:
            requested = math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)
            external = int(kwargs.get("external_weight_memory", args[0] if args else 0) or 0)
            logger.warning(
                "elastickv: %s elastickv starts the engine anyway: its KV cache is committed "
                "on demand under the ledger's budget, not sized from free memory",
                exc,
            )
            return max(int(requested) - external, 0)

    return request_memory


def install_runner_hooks(
    config: ElasticConfig,
    cpu_memory_wrapper: Callable[..., Any],
    contract_hooks: Callable[[], None],
) -> None:
    """Wrap vLLM's GPU worker and model runners (V1, whose CPU classes inherit them, and V2
    where it exists) with the hooks above, the CPU worker's ``determine_available_memory``
    with ``cpu_memory_wrapper``, and let ``contract_hooks`` wrap the version's allocation."""
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    from vllm.v1.worker.cpu_worker import CPUWorker

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

    def gpu_memory_wrapper(original: Callable[..., int]) -> Callable[..., int]:
        def determine_available_memory(self: Any) -> int:
            original(self)  # vLLM's profile run (and compile); its figure is not ours
            return advertised_capacity(self, config)

        return determine_available_memory

    worker = gpu_worker.Worker
    for name, method in ((EXPORT_METHOD, export_kv_pool), (APPLY_METHOD, apply_page_ops)):
        if not hasattr(worker, name):
            setattr(worker, name, method)
    weights_sleep.install(worker)
    wrap_method(worker, "_maybe_get_memory_pool_context", vllm_sleep.pool_context_wrapper)
    if hasattr(worker, "execute_dummy_batch"):  # data parallelism's idle steps
        wrap_method(worker, "execute_dummy_batch", dummy_batch_wrapper)
    if hasattr(gpu_model_runner.GPUModelRunner, "post_kv_cache_wake_up"):
        wrap_method(
            gpu_model_runner.GPUModelRunner, "post_kv_cache_wake_up", vllm_sleep.post_wake_wrapper
        )
    wrap_method(CPUWorker, "determine_available_memory", cpu_memory_wrapper)
    wrap_method(worker, "determine_available_memory", gpu_memory_wrapper)
    if hasattr(gpu_worker, "request_memory"):
        gpu_worker.request_memory = _wrapped_once(gpu_worker.request_memory)
    runners = [gpu_model_runner.GPUModelRunner]
    try:
        from vllm.v1.worker.gpu import model_runner as v2
    except ImportError:  # a vLLM without Model Runner V2
        v2 = None
    if v2 is not None:
        runners.append(v2.GPUModelRunner)
    for runner in runners:
        wrap_method(runner, "initialize_kv_cache", persistent_init_wrapper)
        wrap_method(runner, "execute_model", execute_wrapper)
        if hasattr(runner, "sample_tokens"):
            wrap_method(runner, "sample_tokens", sample_wrapper)
    contract_hooks()


def _wrapped_once(original: Callable[..., int]) -> Callable[..., int]:
    if getattr(original, "__elastickv_original__", None) is not None:
        return original
    wrapper = request_memory_wrapper(original)
    wrapper.__elastickv_original__ = original  # type: ignore[attr-defined]
    return wrapper


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
