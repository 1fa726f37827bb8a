"""Engine-core hooks (the same in vLLM 0.28 and 0.32).

``EngineCore._initialize_kv_caches`` runs in the process that then builds the scheduler,
right after the workers placed their KV caches. We wrap it to ask every worker (by
``collective_rpc`` method name) for its export and publish the scheduler's store: the page
grants its workers follow, registered in the ledger of their device. Doing it here keeps the
order vLLM already guarantees: KV caches placed → scheduler built → blocks handed out.

``EngineCore.step`` (and ``step_with_batch_queue``): a step after which the engine has no
request left (and none in flight) gives its credit back and hands the page operations made
since its ``SchedulerOutput`` (the blocks its last requests freed) to the workers at once,
instead of with a next step that may not come (an in-process ``LLM`` has no idle ticks).
While the engine *waits for memory* (requests wait, none runs, the limit or the device budget
binds: ``ElasticBlockPool.waits_for_memory``), ``step`` is skipped until something that
could change the schedule changed: vLLM would otherwise send its workers an empty step every
millisecond, and their readers would spin.

``EngineCoreProc.run_busy_loop`` (the engine core as its own process) gets two guards: a
limit lowered while the engine idles is applied from the engine's own thread, and its pages
released in the workers (:mod:`.idle_ticks`), and the engine core stops when its parent dies
(:mod:`.watchdog`). Its idle ticks also answer a sleep request in its ledger record
(:mod:`.sleep_requests`); a step with requests wakes a sleeping engine first.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.engine.idle_ticks import tick_while_idle
from elastickv.integrations.vllm.engine.registration import describe_engine
from elastickv.integrations.vllm.engine.sleep_requests import SleepRequests
from elastickv.integrations.vllm.engine.watchdog import ParentWatchdog
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.hooks import wrap_method
from elastickv.integrations.vllm.kv_export import (
    APPLY_METHOD,
    EXPORT_METHOD,
    KVExport,
    geometry_from_wire,
)
from elastickv.integrations.vllm.scheduler.store import REGISTRY, ElasticStore, PolicyFactory

if TYPE_CHECKING:
    from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool

logger = logging.getLogger(__name__)


def connect(config: ElasticConfig, replies: list[Any], policy_factory: PolicyFactory) -> None:
    """Publish the scheduler's store for the workers whose exports are ``replies``; fail
    closed. Under tensor parallelism each rank holds its shard of the KV heads in the same
    geometry, so one grant of page ``i`` stands for page ``i`` on every rank."""
    if not replies:
        raise ElasticKVStartupError("internal: the engine has no KV-cache worker to attach to")
    missing = [rank for rank, reply in enumerate(replies) if reply is None]
    if missing:
        raise ElasticKVStartupError(
            f"worker rank(s) {missing} did not place their KV cache on elastickv storage (is "
            "the elastickv plugin loaded in every worker process, with the same ELASTICKV "
            "settings?)"
        )
    exports = [KVExport.from_wire(reply) for reply in replies]
    first = exports[0]
    geometry = geometry_from_wire(first.geometry)
    for rank, export in enumerate(exports[1:], start=1):
        if geometry_from_wire(export.geometry) != geometry:
            raise ElasticKVStartupError(
                f"worker rank {rank} laid out its KV cache as "
                f"{geometry_from_wire(export.geometry)} but rank 0 as {geometry}; elastickv "
                "needs every rank of an engine to hold the same blocks in the same geometry "
                "(pipeline parallelism is not supported)"
            )
        if (export.size_bytes, export.page_size) != (first.size_bytes, first.page_size):
            raise ElasticKVStartupError(
                f"worker rank {rank} holds {export.size_bytes} bytes in {export.page_size}-byte "
                f"pages but rank 0 {first.size_bytes} in {first.page_size}-byte pages; every "
                "vLLM process of an engine must see the same ELASTICKV settings"
            )
    if first.page_size != config.page_size:
        raise ElasticKVStartupError(
            f"the workers use {first.page_size}-byte pages but the engine core "
            f"{config.page_size}; every vLLM process must see the same ELASTICKV_PAGE_SIZE"
        )
    devices = sorted({export.device for export in exports})
    if len(devices) > 1:
        raise ElasticKVStartupError(
            f"the workers of this engine charge their KV pages to the ledgers of several "
            f"devices ({', '.join(devices)}); elastickv supports an engine on one device's "
            "ledger (its workers on one host, or tensor parallelism on one GPU) for now"
        )
    store = ElasticStore.for_workers(
        config, geometry, first.size_bytes, len(exports), devices[0], policy_factory
    )
    REGISTRY.publish(store)
    logger.info(
        "elastickv: scheduler (pid %d) grants the KV pages of %d worker rank(s), pids %s "
        "(%d bytes each, %d-byte pages); each maps them in its own process",
        os.getpid(),
        len(exports),
        ", ".join(str(export.pid) for export in exports),
        first.size_bytes,
        first.page_size,
    )


# The engine core's attribute holding its :class:`SleepRequests` (absent: no idle ticks).
_SLEEP_REQUESTS = "_elastickv_sleep_requests"

# How long the engine core sleeps per loop while it waits for memory (new requests are read
# between two sleeps; the ledger is asked for credit every CREDIT_RETRY_S).
MEMORY_WAIT_POLL_S = 0.005


def flush_page_ops(engine_core: Any, pool: ElasticBlockPool) -> None:
    """Hand the page operations not yet sent to the workers, and have them release what they
    still hold: the engine has no step in flight and none may come soon."""
    ops = pool.take_page_ops()
    if ops is not None:
        engine_core.collective_rpc(APPLY_METHOD, args=(ops,))


def install(config: ElasticConfig, policy_factory: PolicyFactory) -> None:
    from vllm.v1.engine.core import EngineCore

    def init_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
            kv_cache_config = original(self, vllm_config)
            describe_engine(vllm_config)
            connect(config, list(self.collective_rpc(EXPORT_METHOD)), policy_factory)
            return kv_cache_config

        return _initialize_kv_caches

    def step_wrapper(original: Callable[..., Any], *, may_wait: bool) -> Callable[..., Any]:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            sleep = getattr(self, _SLEEP_REQUESTS, None)
            if sleep is not None and sleep.asleep and self.scheduler.has_unfinished_requests():
                sleep.before_step()
            pool = _grants_pool(self)
            if may_wait and pool is not None and pool.waits_for_memory(self.scheduler):
                # The step would schedule nothing again: skip it, and its round trip to
                # every worker (vLLM's loop sleeps 1 ms more and reads new requests).
                time.sleep(MEMORY_WAIT_POLL_S)
                return {}, False
            result = original(self, *args, **kwargs)
            if may_wait and pool is not None:
                pool.note_step(self.scheduler, bool(result[1]))
            if (
                pool is not None
                and not pool.idle
                and not self.scheduler.has_unfinished_requests()
                and not getattr(self, "batch_queue", None)
            ):
                pool.went_idle()
                flush_page_ops(self, pool)
            return result

        return step

    wrap_method(EngineCore, "_initialize_kv_caches", init_wrapper)
    wrap_method(EngineCore, "step", functools.partial(step_wrapper, may_wait=True))
    if hasattr(EngineCore, "step_with_batch_queue"):
        # Steps in flight (pipeline parallelism, asynchronous scheduling): vLLM's own loop.
        wrap_method(
            EngineCore, "step_with_batch_queue", functools.partial(step_wrapper, may_wait=False)
        )

    from vllm.v1.engine.core import EngineCoreProc

    def loop_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def run_busy_loop(self: Any) -> Any:
            guard_process(self, config.sleep_level)
            return original(self)

        return run_busy_loop

    wrap_method(EngineCoreProc, "run_busy_loop", loop_wrapper)


def _grants_pool(engine_core: Any) -> ElasticBlockPool | None:
    from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool

    scheduler = getattr(engine_core, "scheduler", None)
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    return pool if isinstance(pool, ElasticBlockPool) else None


def guard_process(engine_core: Any, sleep_level: int = 1) -> None:
    """Before the engine core's loop: the parent watchdog (when vLLM started this process as
    a child) and idle ticks that apply the live limit (when the scheduler is elastic)."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        ParentWatchdog(parent.pid).start()
    pool = _grants_pool(engine_core)
    if pool is None:
        return

    registration = pool.registration
    sleep = None
    if registration is not None:
        sleep = SleepRequests(
            engine_core, registration.handle, sleep_level, lambda: flush_page_ops(engine_core, pool)
        )
    setattr(engine_core, _SLEEP_REQUESTS, sleep)

    def idle() -> None:
        pool.idle_tick()
        flush_page_ops(engine_core, pool)
        if sleep is not None:  # after the KV went back to the limit: the weights
            sleep.on_idle()

    if not tick_while_idle(getattr(engine_core, "input_queue", None), idle):
        logger.warning(
            "elastickv: cannot watch this engine core's input queue; a limit lowered while "
            "it idles applies at its next request"
        )
