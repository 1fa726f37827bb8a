"""The engine core's side of sleep: a request in its ledger record answered from its own
thread.

``elastickv serve`` asks an idle engine to put its model's weights to sleep through the
engine's ledger record (``Ledger.request_sleep``): nothing new is exposed (no development
endpoint, no socket), and the request dies with the record when the engine does. The engine
core looks at the record on its idle ticks (:mod:`.idle_ticks`: its own thread, no step in
flight) and answers there:

* wanted and awake: every worker rank releases its weights (``elastickv_sleep_weights``, see
  :mod:`elastickv.integrations.vllm.worker.weights_sleep`: on the CPU elastickv's own, on a
  GPU vLLM's sleep mode at ``ELASTICKV_SLEEP_LEVEL``); the record then says *asleep*. A rank
  that cannot (a GPU engine started without ``--enable-sleep-mode``) makes the record say
  *refused*, and every rank is woken again, so no rank is left without weights. Before a
  level-2 sleep (weights reloaded from the checkpoint on wake) the prefix cache is reset.
* not wanted and asleep (the request was withdrawn): every rank reloads its weights.

A step with requests wakes every rank first, whatever the record says (:meth:`before_step`):
a request that reaches a sleeping engine waits for the reload and is answered. Serve withdraws
its request when it forwards the request, so the engine does not fall asleep again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from elastickv.control import InstanceHandle
from elastickv.control.errors import LedgerError
from elastickv.integrations.vllm.worker.weights_sleep import SLEEP_METHOD, WAKE_METHOD

logger = logging.getLogger(__name__)


class SleepRequests:
    """Answers the sleep requests in one engine's ledger record (engine core thread only)."""

    def __init__(
        self,
        engine_core: Any,
        handle: InstanceHandle,
        level: int = 1,
        flush: Callable[[], None] | None = None,
    ) -> None:
        self.engine_core = engine_core
        self.handle = handle
        self.level = level
        self.flush = flush  # hands freed pages to the workers (after a prefix-cache reset)
        self.asleep = False
        self.refused = False  # answered "cannot" to the request in force: not asked again
        self.sleeps = 0
        self.wakes = 0

    def on_idle(self) -> None:
        """An idle tick: act on the record's request. A ledger that cannot be read leaves
        things as they are (the next tick asks again)."""
        if self.handle.closed:
            return
        try:
            wanted = self.handle.sleep_wanted()
        except LedgerError as exc:
            logger.warning("elastickv: cannot read this engine's sleep request: %s", exc)
            return
        if wanted and not self.asleep and not self.refused:
            self.sleep()
        elif not wanted:
            self.refused = False
            if self.asleep:
                self.wake("the sleep request was withdrawn")

    def before_step(self) -> None:
        """A step is about to run: the weights must be there."""
        if self.asleep:
            self.wake("a request arrived")

    def sleep(self) -> None:
        began = time.perf_counter()
        if self.level == 2:  # the reload may not give back the very bytes the cache was made of
            self.engine_core.reset_prefix_cache()
            if self.flush is not None:
                self.flush()
        try:
            replies = list(
                self.engine_core.collective_rpc(SLEEP_METHOD, kwargs={"level": self.level})
            )
        except Exception as exc:
            logger.warning(
                "elastickv: this engine cannot put its weights to sleep (%s); it stays awake "
                "and answers the request as refused",
                exc,
            )
            self._wake_ranks()  # a rank that did release gets its weights back
            self.refused = True
            self._answer(asleep=False, refused=True)
            return
        self.asleep = True
        self.sleeps += 1
        self._answer(asleep=True)
        released = sum(int(reply.get("released_bytes", 0)) for reply in replies if reply)
        logger.info(
            "elastickv: weights asleep on %d rank(s): %d parameter bytes released in %.3f s",
            len(replies),
            released,
            time.perf_counter() - began,
        )

    def wake(self, why: str) -> None:
        began = time.perf_counter()
        self._wake_ranks(strict=True)
        self.asleep = False
        self.wakes += 1
        self._answer(asleep=False)
        logger.info("elastickv: weights awake in %.3f s (%s)", time.perf_counter() - began, why)

    def _wake_ranks(self, strict: bool = False) -> None:
        try:
            self.engine_core.collective_rpc(WAKE_METHOD)
        except Exception:
            if strict:  # a model without its weights must not run: the engine stops
                raise
            logger.exception("elastickv: waking the ranks after a refused sleep failed")

    def _answer(self, *, asleep: bool, refused: bool = False) -> None:
        try:
            self.handle.set_sleep_state(asleep=asleep, refused=refused)
        except LedgerError as exc:
            logger.warning("elastickv: cannot record this engine's sleep state: %s", exc)
