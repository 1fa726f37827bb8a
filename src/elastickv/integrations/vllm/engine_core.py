"""Engine-core hooks (the same in vLLM 0.28 and 0.32).

``EngineCore._initialize_kv_caches`` runs in the process that then builds the scheduler,
right after the workers allocated their KV caches. We wrap it to ask the worker (by
``collective_rpc`` method name) where its pool is and, when the worker is another process,
open that pool and publish a store for the scheduler's :class:`ElasticBlockPool`. Doing it
here keeps the order vLLM already guarantees: pool exists → scheduler built → blocks handed
out.

``EngineCoreProc.run_busy_loop`` (the engine core as its own process) gets two guards: a
limit lowered while the engine idles is applied from the engine's own thread
(:mod:`.idle_ticks`), and the engine core stops when its parent dies (:mod:`.watchdog`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.hooks import wrap_method
from elastickv.integrations.vllm.idle_ticks import tick_while_idle
from elastickv.integrations.vllm.registration import describe_engine
from elastickv.integrations.vllm.shared_pool import (
    EXPORT_METHOD,
    IN_PROCESS,
    PoolExport,
    geometry_from_wire,
    open_exported,
)
from elastickv.integrations.vllm.store import REGISTRY, ElasticStore, PolicyFactory
from elastickv.integrations.vllm.watchdog import ParentWatchdog
from elastickv.vmm import HostRange, ShardedRange, VirtualRange

logger = logging.getLogger(__name__)


def connect(config: ElasticConfig, replies: list[Any], policy_factory: PolicyFactory) -> None:
    """Publish the scheduler's store over every worker rank's pool in ``replies``; fail
    closed. Under tensor parallelism each rank holds its shard of the KV heads in the same
    geometry, so one allocator drives all ranks through a :class:`ShardedRange`."""
    if not replies:
        raise ElasticKVStartupError("internal: the engine has no KV-cache worker to attach to")
    missing = [rank for rank, reply in enumerate(replies) if reply is None]
    if missing:
        raise ElasticKVStartupError(
            f"worker rank(s) {missing} did not place their KV cache on elastickv storage (is "
            "the elastickv plugin loaded in every worker process, with the same ELASTICKV "
            "settings?)"
        )
    exports = [PoolExport.from_wire(reply) for reply in replies]
    geometry = geometry_from_wire(exports[0].geometry)
    for rank, export in enumerate(exports[1:], start=1):
        if geometry_from_wire(export.geometry) != geometry:
            raise ElasticKVStartupError(
                f"worker rank {rank} laid out its KV cache as "
                f"{geometry_from_wire(export.geometry)} but rank 0 as {geometry}; elastickv "
                "needs every rank of an engine to hold the same blocks in the same geometry "
                "(pipeline parallelism is not supported)"
            )
    first = exports[0]
    if len(exports) == 1 and first.mapping == IN_PROCESS and first.pid == os.getpid():
        store = REGISTRY.require()
        if store.geometry != geometry:
            raise ElasticKVStartupError("internal: the worker's geometry differs from its store")
        return
    ranges: list[HostRange] = []
    try:
        for export in exports:
            ranges.append(open_exported(config, export))
    except BaseException:
        for opened in ranges:
            opened.close()
        raise
    vmm_range: VirtualRange = ranges[0] if len(ranges) == 1 else ShardedRange(ranges)
    REGISTRY.publish(
        ElasticStore.over(config, geometry, vmm_range, first.size_bytes, policy_factory)
    )
    logger.info(
        "elastickv: scheduler (pid %d) drives the KV pools of %d worker rank(s), pids %s "
        "(%d bytes each, %d-byte pages)",
        os.getpid(),
        len(exports),
        ", ".join(str(export.pid) for export in exports),
        ranges[0].size_bytes,
        first.page_size,
    )


def install(config: ElasticConfig, policy_factory: PolicyFactory) -> None:
    from vllm.v1.engine.core import EngineCore

    def init_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
            kv_cache_config = original(self, vllm_config)
            describe_engine(vllm_config)
            connect(config, list(self.collective_rpc(EXPORT_METHOD)), policy_factory)
            return kv_cache_config

        return _initialize_kv_caches

    wrap_method(EngineCore, "_initialize_kv_caches", init_wrapper)

    from vllm.v1.engine.core import EngineCoreProc

    def loop_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def run_busy_loop(self: Any) -> Any:
            guard_process(self)
            return original(self)

        return run_busy_loop

    wrap_method(EngineCoreProc, "run_busy_loop", loop_wrapper)


def guard_process(engine_core: Any) -> None:
    """Before the engine core's loop: the parent watchdog (when vLLM started this process as
    a child) and idle ticks that apply the live limit (when the scheduler is elastic)."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        ParentWatchdog(parent.pid).start()
    from elastickv.integrations.vllm.block_pool import ElasticBlockPool

    scheduler = getattr(engine_core, "scheduler", None)
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    if isinstance(pool, ElasticBlockPool) and not tick_while_idle(
        getattr(engine_core, "input_queue", None), pool.idle_tick
    ):
        logger.warning(
            "elastickv: cannot watch this engine core's input queue; a limit lowered while "
            "it idles applies at its next request"
        )
