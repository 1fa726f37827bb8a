"""Scheduler-side hooks, the same for vLLM 0.28–0.32: an elastic block pool and the
admission window. Only the pool class differs by version (``scheduler_v028`` supplies 0.28's).

Three touch points in ``vllm.v1.core``:

* ``kv_cache_coordinator.BlockPool`` → the elastic pool class (every coordinator builds its
  pool through that name; there is no injection parameter);
* ``KVCacheCoordinator.get_num_blocks_to_allocate`` → also tells the pool the number;
* ``KVCacheManager.allocate_slots`` → runs inside the pool's allocation window, so backing
  happens before vLLM's fit check and unused backing is returned right after; admitting a
  waiting request also needs one block of headroom per running request whose next token
  needs a new block (the pool reads the scheduler's own table of requests, handed to it once).

Both run for every running request in every step, so each is compiled with the hooked
method's own signature (:func:`~elastickv.integrations.vllm.hooks.compile_hook`).

And three on ``vllm.v1.core.sched.scheduler.Scheduler``: ``schedule`` first applies the
engine's live ledger limit (:meth:`ElasticBlockPool.sync_limit`) and afterwards forecasts the
next step's blocks for the pre-commit thread (:meth:`ElasticBlockPool.forecast_demand`);
``update_from_output`` hands the blocks its finished requests free to the allocator in one
batch (:meth:`ElasticBlockPool.begin_free_batch`); ``shutdown`` returns the pages and
unregisters the engine from the ledger.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastickv.integrations.vllm.hooks import compile_hook, wrap_method

if TYPE_CHECKING:
    from elastickv.integrations.vllm.block_pool import ElasticBlockPool


# The two hooks on every running request's path in every step, compiled with the hooked
# method's own signature (:func:`~elastickv.integrations.vllm.hooks.compile_hook`).
EXPECT_HOOK = """
def {name}({signature}):
    num = original({arguments})
    # 0 (most calls: running requests between blocks) needs no backing, and the pool
    # answers vLLM's own free count when it was told nothing.
    if num:
        pool = self.block_pool
        if isinstance(pool, ElasticBlockPool):
            pool.expect(num, new_computed_blocks)
    return num
"""
# Once per step each, also compiled: ``schedule`` applies the live limit first and forecasts
# the next step's blocks afterwards; ``update_from_output`` frees its finished requests'
# blocks in one batch. Both start by finding the pool by attribute (no ``getattr`` defaults)
# on the path every step takes; a scheduler without one is left to ``elastic_pool``.
_STEP_HOOK_START = """
def {name}({signature}):
    try:
        pool = self.kv_cache_manager.block_pool
    except AttributeError:
        pool = elastic_pool(self)
    if not isinstance(pool, ElasticBlockPool):
        return original({arguments})
"""
SCHEDULE_HOOK = (
    _STEP_HOOK_START
    + """    pool.sync_limit()  # live limits, once per step, in the scheduler's thread
    if pool.tracked_requests is not self.requests:
        pool.track_requests(self.requests)  # for the admission headroom
    output = original({arguments})
    pool.forecast_demand(self)  # the next step's pages, committed while this one runs
    return output
"""
)
UPDATE_HOOK = (
    _STEP_HOOK_START
    + """    pool.begin_free_batch()  # finished requests' blocks reach the allocator at once
    try:
        return original({arguments})
    finally:
        pool.end_free_batch()
"""
)
WINDOW_HOOK = """
def {name}({signature}):
    pool = self.block_pool
    if not isinstance(pool, ElasticBlockPool):
        return original({arguments})
    if request.status is running_status:  # a running request's growth: no headroom
        pool.open_window(0)
    else:
        pool.open_admission(self, request)
    try:
        return original({arguments})
    finally:
        pool.close_window()
"""


def install(pool_class: type[ElasticBlockPool] | None = None) -> None:
    """Install the hooks; ``pool_class`` (default :class:`ElasticBlockPool`) is the pool
    every coordinator builds."""
    from vllm.v1.core import kv_cache_coordinator, kv_cache_manager
    from vllm.v1.core.sched import scheduler
    from vllm.v1.request import RequestStatus

    from elastickv.integrations.vllm.block_pool import ElasticBlockPool

    running_status = RequestStatus.RUNNING
    names = {
        "ElasticBlockPool": ElasticBlockPool,
        "running_status": running_status,
        "elastic_pool": _elastic_pool,
    }

    kv_cache_coordinator.BlockPool = pool_class or ElasticBlockPool

    def need_wrapper(original: Callable[..., int]) -> Callable[..., int]:
        # (request_id, num_tokens, new_computed_blocks, ...) in 0.28 and 0.32
        fast = compile_hook(original, EXPECT_HOOK, names, uses=("self", "new_computed_blocks"))
        if fast is not None:
            return fast
        hits_at = _parameter_index(original, "new_computed_blocks", 3)

        def get_num_blocks_to_allocate(self: Any, *args: Any, **kwargs: Any) -> int:
            num = original(self, *args, **kwargs)
            pool = self.block_pool
            if num and isinstance(pool, ElasticBlockPool):
                hits = kwargs.get(
                    "new_computed_blocks", args[hits_at - 1] if len(args) >= hits_at else ()
                )
                pool.expect(num, hits)
            return num

        return get_num_blocks_to_allocate

    def window_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        fast = compile_hook(original, WINDOW_HOOK, names, uses=("self", "request"))
        if fast is not None:
            return fast

        def allocate_slots(self: Any, *args: Any, **kwargs: Any) -> Any:
            pool = self.block_pool
            if not isinstance(pool, ElasticBlockPool):
                return original(self, *args, **kwargs)
            request: Any = kwargs["request"] if "request" in kwargs else args[0]
            if request.status is running_status:
                pool.open_window(0)
            else:
                pool.open_admission(self, request)
            try:
                return original(self, *args, **kwargs)
            finally:
                pool.close_window()

        return allocate_slots

    def schedule_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        fast = compile_hook(original, SCHEDULE_HOOK, names, uses=("self",))
        if fast is not None:
            return fast

        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            pool = _elastic_pool(self)
            if pool is None:
                return original(self, *args, **kwargs)
            pool.sync_limit()
            if pool.tracked_requests is not self.requests:
                pool.track_requests(self.requests)
            output = original(self, *args, **kwargs)
            pool.forecast_demand(self)
            return output

        return schedule

    def update_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        fast = compile_hook(original, UPDATE_HOOK, names, uses=("self",))
        if fast is not None:
            return fast

        def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
            pool = _elastic_pool(self)
            if pool is None:
                return original(self, *args, **kwargs)
            pool.begin_free_batch()
            try:
                return original(self, *args, **kwargs)
            finally:
                pool.end_free_batch()

        return update_from_output

    def shutdown_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(self, *args, **kwargs)
            finally:
                pool = _elastic_pool(self)
                if pool is not None:
                    pool.close_elastic()  # pages back, ledger record gone

        return shutdown

    wrap_method(kv_cache_coordinator.KVCacheCoordinator, "get_num_blocks_to_allocate", need_wrapper)
    wrap_method(kv_cache_manager.KVCacheManager, "allocate_slots", window_wrapper)
    wrap_method(scheduler.Scheduler, "schedule", schedule_wrapper)
    wrap_method(scheduler.Scheduler, "update_from_output", update_wrapper)
    wrap_method(scheduler.Scheduler, "shutdown", shutdown_wrapper)


def _elastic_pool(scheduler: Any) -> ElasticBlockPool | None:
    """The scheduler's block pool if it is elastic (None for a native engine's)."""
    from elastickv.integrations.vllm.block_pool import ElasticBlockPool

    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    return pool if isinstance(pool, ElasticBlockPool) else None


def _parameter_index(function: Callable[..., Any], name: str, default: int) -> int:
    """Position of parameter ``name`` in ``function``'s signature (``self`` is 0)."""
    names = list(inspect.signature(function).parameters)
    return names.index(name) if name in names else default
