"""Scheduler-side hooks, the same for vLLM 0.28–0.32: an elastic block pool and one per-step
hook. Only the pool class differs by version (``scheduler_v028`` supplies 0.28's).

``vllm.v1.core.kv_cache_coordinator.BlockPool`` becomes the elastic pool class (every
coordinator builds its pool through that name; there is no injection parameter). The pool
answers vLLM's free-block count from room it holds (see :mod:`.block_pool`), so nothing
hooks vLLM's per-request paths.

On ``vllm.v1.core.sched.scheduler.Scheduler``: ``schedule`` first applies the engine's live
ledger limit, hands the blocks freed since the last step to the allocator and moves its
credit to the step's demand (:meth:`ElasticBlockPool.begin_step`), and afterwards hands the
step's page operations to its ``SchedulerOutput``, for the workers to map
(:meth:`ElasticBlockPool.end_step`); ``shutdown`` returns the pages and unregisters the
engine from the ledger. The per-step hook is compiled with vLLM's own signature
(:func:`~elastickv.integrations.vllm.hooks.compile_hook`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastickv.integrations.vllm.hooks import compile_hook, wrap_method

if TYPE_CHECKING:
    from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool


# Once per step: it finds the pool by attribute (no ``getattr`` defaults) on the path every
# step takes; a scheduler without one is left to ``elastic_pool``.
SCHEDULE_HOOK = """
def {name}({signature}):
    try:
        pool = self.kv_cache_manager.block_pool
    except AttributeError:
        pool = elastic_pool(self)
    if not isinstance(pool, ElasticBlockPool):
        return original({arguments})
    pool.begin_step(self)  # frees handed over, live limit, credit, admission headroom
    output = original({arguments})
    pool.end_step(self, output)  # the step's page operations ride with its output
    return output
"""


def install(pool_class: type[ElasticBlockPool] | None = None) -> None:
    """Install the hooks; ``pool_class`` (default :class:`ElasticBlockPool`) is the pool
    every coordinator builds."""
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.sched import scheduler

    from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool

    names = {"ElasticBlockPool": ElasticBlockPool, "elastic_pool": _elastic_pool}

    kv_cache_coordinator.BlockPool = pool_class or ElasticBlockPool

    def schedule_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        fast = compile_hook(original, SCHEDULE_HOOK, names, uses=("self",))
        if fast is not None:
            return fast

        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            pool = _elastic_pool(self)
            if pool is None:
                return original(self, *args, **kwargs)
            pool.begin_step(self)
            output = original(self, *args, **kwargs)
            pool.end_step(self, output)
            return output

        return schedule

    def shutdown_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(self, *args, **kwargs)
            finally:
                pool = _elastic_pool(self)
                if pool is not None:
                    pool.close_elastic()  # pages back, ledger record gone

        return shutdown

    wrap_method(scheduler.Scheduler, "schedule", schedule_wrapper)
    wrap_method(scheduler.Scheduler, "shutdown", shutdown_wrapper)


def _elastic_pool(scheduler: Any) -> ElasticBlockPool | None:
    """The scheduler's block pool if it is elastic (None for a native engine's)."""
    from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool

    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    return pool if isinstance(pool, ElasticBlockPool) else None
