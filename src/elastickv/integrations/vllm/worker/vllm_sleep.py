"""Sleep and wake on a GPU worker, through vLLM's own sleep mode, with the KV cache left on
elastic storage.

On a GPU, vLLM allocates a model's weights inside its sleep-mode memory pool (CuMem, started
with ``--enable-sleep-mode``), tagged ``weights``; ``Worker.sleep(level)`` unmaps the pool's
allocations, level 1 after copying the weights to host memory, level 2 discarding them, and
``Worker.wake_up`` maps them again at the same addresses (CUDA graphs stay valid). The pool
holds only what torch's allocator gives out inside it: elastickv's KV cache is a tensor over
its own reserved range, never in the pool, so no level touches it, and the plugin keeps
vLLM's ``kv_cache`` pool out of use altogether (:func:`pool_context_wrapper`; in vLLM 0.28
that pool also held other start-up buffers, which a weights-only wake would not restore).

What elastickv does not use of vLLM's sleep: ``EngineCore.sleep`` (its HTTP ``/sleep``) pauses
the scheduler, aborts requests and resets every cache, and its wake must be called before any
request; elastickv's sleep is the engine core's idle-tick answer to a ledger request instead
(:mod:`elastickv.integrations.vllm.engine.sleep_requests`), and a step wakes the worker
first. So the RPCs here call the worker's own ``sleep`` / ``wake_up`` (and ``reload_weights``
after a level-2 wake, as vLLM's own callers do).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)
SLEEP_LEVELS = (1, 2)
# vLLM's check after a sleep that device-wide free memory did not fall; on a GPU shared with
# other elastic engines committing KV pages at that moment it can, after the sleep happened.
_MEMORY_ASSERT = "Memory usage increased after sleeping"


@dataclass(frozen=True)
class GpuSleep:
    """A worker asleep through vLLM's sleep mode at ``level`` (kept on its model runner)."""

    worker: Any
    level: int


def sleep_mode_backend(worker: Any) -> Any:
    """The worker's sleep-mode backend (a property in vLLM 0.32, a method in 0.28)."""
    getter = getattr(worker, "_get_sleep_mode_backend", None)
    return getter() if callable(getter) else worker.sleep_mode_backend


def weights_pool_bytes() -> int | None:
    """Bytes vLLM's CuMem pool holds under the ``weights`` tag (None: not readable)."""
    try:
        from vllm.device_allocator import get_mem_allocator_instance

        allocator = get_mem_allocator_instance()
        return sum(
            int(data.handle[1])
            for data in allocator.pointer_to_data.values()
            if data.tag == "weights"
        )
    except Exception:  # a platform without CuMem, or another allocator's layout
        return None


def refusal(worker: Any, level: int) -> str | None:
    """Why this GPU worker cannot sleep at ``level`` now (None: it can)."""
    model_config = worker.vllm_config.model_config
    if level not in SLEEP_LEVELS:
        return f"sleep level {level}: use 1 (weights offloaded to host memory) or 2 (discarded)"
    if not getattr(model_config, "enable_sleep_mode", False):
        return (
            "this engine was started without --enable-sleep-mode: vLLM loaded its weights "
            "outside its sleep-mode memory pool, so they cannot be released; start it with "
            "--enable-sleep-mode"
        )
    state = str(sleep_mode_backend(worker).state())
    if not state.endswith("RUNNING"):
        return (
            f"vLLM's own sleep mode has this engine {state.lower()} (its /sleep route); wake "
            "it with /wake_up first"
        )
    return None


def sleep(worker: Any, level: int) -> tuple[GpuSleep, dict[str, Any]]:
    """Release ``worker``'s weights at ``level``: the state to keep on its runner, and the
    reply. Raises ``RuntimeError`` (nothing released) when it cannot."""
    why = refusal(worker, level)
    if why is not None:
        raise RuntimeError(f"elastickv: {why}")
    start = time.perf_counter()
    released = weights_pool_bytes()
    try:
        worker.sleep(level)
    except AssertionError as exc:
        state = str(sleep_mode_backend(worker).state())
        if _MEMORY_ASSERT not in str(exc) or not state.endswith("SUSPENDED"):
            raise
        logger.warning(
            "elastickv: vLLM saw the GPU's free memory fall during the sleep (another engine "
            "committed meanwhile); the weights are released all the same"
        )
    seconds = time.perf_counter() - start
    logger.info(
        "elastickv: weights asleep (vLLM sleep level %d): %s bytes released in %.3f s",
        level,
        "?" if released is None else released,
        seconds,
    )
    reply = {"asleep": True, "level": level, "released_bytes": released or 0, "sleep_s": seconds}
    return GpuSleep(worker, level), reply


def wake(slept: GpuSleep) -> dict[str, Any]:
    """Map the weights again (level 1: copied back from host memory; level 2: reloaded from
    the checkpoint in place)."""
    start = time.perf_counter()
    slept.worker.wake_up(tags=["weights"])
    reload_s = 0.0
    if slept.level == 2:
        began = time.perf_counter()
        slept.worker.reload_weights()
        reload_s = time.perf_counter() - began
        with contextlib.suppress(Exception):  # the reload's transient buffers
            import torch

            torch.cuda.empty_cache()
    total = time.perf_counter() - start
    logger.info("elastickv: weights awake in %.3f s (vLLM sleep level %d)", total, slept.level)
    return {"woken": True, "level": slept.level, "wake_s": total, "reload_s": reload_s}


def pool_context_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """The GPU worker's ``_maybe_get_memory_pool_context``: vLLM's ``kv_cache`` pool is not
    used (elastickv places and owns the KV cache); the other pools are vLLM's."""

    def _maybe_get_memory_pool_context(self: Any, tag: str) -> Any:
        if tag == "kv_cache":
            return contextlib.nullcontext()
        return original(self, tag)

    return _maybe_get_memory_pool_context


def post_wake_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM 0.28's ``post_kv_cache_wake_up`` zeroes every KV tensor of a quantized KV cache
    after a wake that names ``kv_cache`` (its pool's memory came back uninitialised). An
    elastic KV cache was never released: zeroing it would wipe its blocks and write the
    shared zero page under its uncommitted pages. Only the scales are reset."""

    def post_kv_cache_wake_up(self: Any, *args: Any, **kwargs: Any) -> Any:
        from elastickv.integrations.vllm.worker.worker import runner_kv

        if runner_kv(self) is None:
            return original(self, *args, **kwargs)
        caches = self.kv_caches
        self.kv_caches = []
        try:
            return original(self, *args, **kwargs)
        finally:
            self.kv_caches = caches

    return post_kv_cache_wake_up
