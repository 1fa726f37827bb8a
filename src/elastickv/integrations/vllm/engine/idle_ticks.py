"""Run a callback in the engine core's own thread while it waits for work.

An idle vLLM engine core blocks in ``input_queue.get()`` and never reaches
``Scheduler.schedule``, where elastickv applies a lowered ledger limit. A limit lowered while
the engine is idle (``elastickv serve`` releasing a sleeping model's KV, or an operator's
``elastickv limit``) must still take effect, and from the scheduler's own thread: nothing
else may touch the block pool. :func:`tick_while_idle` turns the engine core's input queue
into an :class:`IdleTickQueue`, whose blocking ``get`` wakes every ``interval`` seconds to
run the callback in the waiting thread — the engine core's main thread.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)
IDLE_TICK_S = 0.25


class IdleTickQueue(queue.Queue):  # type: ignore[type-arg]
    """A ``queue.Queue`` whose untimed blocking ``get`` runs ``on_idle`` between waits."""

    on_idle: Callable[[], Any]
    idle_interval: float

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if not block or timeout is not None:
            return super().get(block, timeout)
        while True:
            try:
                return super().get(True, self.idle_interval)
            except queue.Empty:
                try:
                    self.on_idle()
                except Exception:  # an idle chore must never take the engine down
                    logger.exception("elastickv: idle tick failed")


def tick_while_idle(
    input_queue: Any, on_idle: Callable[[], Any], interval: float = IDLE_TICK_S
) -> bool:
    """Make ``input_queue`` (a plain ``queue.Queue``) tick ``on_idle``; False if it is not
    one (then nothing changes). The object keeps its identity and contents: the threads that
    already hold it keep working."""
    if type(input_queue) is not queue.Queue and not isinstance(input_queue, IdleTickQueue):
        return False
    input_queue.__class__ = IdleTickQueue
    ticking: IdleTickQueue = input_queue  # type: ignore[assignment]
    ticking.on_idle = on_idle
    ticking.idle_interval = interval
    return True
