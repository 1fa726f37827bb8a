"""One served model's life: start, serve, release its KV when idle, sleep, stop, wake, restart.

States (what ``/v1/models`` and ``elastickv list`` show):

* ``starting`` – the engine is starting (first start, wake from ``stopped``, or a restart
  after a crash); requests wait in the model's bounded queue.
* ``serving`` – requests are in flight.
* ``idle`` – running with nothing in flight; after ``release_after`` it becomes
* ``kv-released`` – tier 1: its limit is at the engine's floor, so the plugin dropped its hot
  reserve and prefix cache; the next request raises the limit again (no restart).
* ``asleep`` – tier 2 (after ``sleep_after``): the engine process stays up, its model's
  weights released (asked through its ledger record; it becomes ``asleep`` when the engine
  answers). The next request is forwarded at once and waits in the engine for the reload. An
  engine that cannot sleep (on a GPU, one started without ``--enable-sleep-mode``) refuses,
  or does not answer within ``SLEEP_ANSWER_S``: the model stays ``kv-released`` and is not
  asked again.
* ``stopped`` – tier 3 (after ``stop_after``, unless pinned): no engine process; the next
  request starts it, one wake at a time, others waiting.
* ``failed`` – it crashed or failed to start ``MAX_RESTARTS`` times in a row; requests get 503.

Everything runs on the serve event loop: state changes happen between awaits, never
concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from elastickv.serve.config import ModelConfig
from elastickv.serve.engine import EngineLaunch, EngineProcess, EngineStartError

logger = logging.getLogger("elastickv.serve")
MAX_RESTARTS = 5
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
START_TIMEOUT_S = 600.0
# How long an engine may take to answer a sleep request (it answers on its next idle tick,
# within a second; an engine without elastickv's sleep never does).
SLEEP_ANSWER_S = 30.0


class ModelState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    IDLE = "idle"
    KV_RELEASED = "kv-released"
    ASLEEP = "asleep"
    STOPPED = "stopped"
    FAILED = "failed"


# States with a running engine that takes requests at once.
_READY = (ModelState.SERVING, ModelState.IDLE, ModelState.KV_RELEASED, ModelState.ASLEEP)


class Unavailable(Exception):
    """A request the model cannot take now: HTTP ``status``, an OpenAI-style message, and
    for 429/503 how long to wait before retrying."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass
class ModelHooks:
    """What a model needs from the rest of ``serve`` (wired by the app)."""

    launch: Callable[[ModelConfig], EngineLaunch]  # a fresh launch (new port) per start
    session: aiohttp.ClientSession
    changed: Callable[[], None]  # a state or demand change: wake the arbiter, the state file
    restore_kv: Callable[[str], Awaitable[None]]  # raise a released model's limit to min_kv
    release_kv: Callable[[str], Awaitable[None]]  # lower it to the engine's floor
    engine_ready: Callable[[str], Awaitable[None]]  # the engine is healthy (its floor is read)
    woke: Callable[[str, str, float], None]  # (model, tier, seconds) for metrics
    # Ask the engine to put its weights to sleep (True) or keep them awake (False).
    request_sleep: Callable[[str, bool], None]
    # The engine's answer in its ledger record: "asleep", "refused", or None (none yet).
    sleep_answer: Callable[[str], str | None]


class ServedModel:
    """The supervisor of one model (see the module doc)."""

    def __init__(self, config: ModelConfig, hooks: ModelHooks, *, queue_limit: int,
                 wake_timeout_s: float) -> None:  # fmt: skip
        self.config = config
        self.hooks = hooks
        self.queue_limit = queue_limit
        self.wake_timeout_s = wake_timeout_s
        # Until its first start every model is "starting": requests wait for the boot (which
        # starts the engines one at a time) instead of waking it out of turn.
        self.state = ModelState.STARTING
        self.engine: EngineProcess | None = None
        self.in_flight = 0
        self.waiting = 0
        self.last_active = time.monotonic()
        self.restarts = 0
        self.failures_in_row = 0
        self.last_start_s: float | None = None
        self.last_error: str | None = None
        self.floor_bytes = 0
        # Sleep: when it was asked of the engine (None: not asked), and why the engine cannot.
        self.sleep_asked_at: float | None = None
        self.sleep_refused: str | None = None
        self.stopped_on_exit: list[int] = []  # engines stopped because serve is stopping
        self._ready = asyncio.Event()
        self._lifecycle = asyncio.Lock()
        self._wake: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._closing = False
        self.removed = False  # taken out through the models API: nothing more is admitted

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str | None:
        return None if self.engine is None else self.engine.launch.url()

    def current(self) -> ModelState:
        return self.state

    def _set(self, state: ModelState) -> None:
        if state is not self.state:
            before, self.state = self.state, state
            if state in _READY:
                self._ready.set()
            else:
                self._ready.clear()
            self.hooks.changed()  # published before it is logged: a logged state is listed
            logger.info("%s: %s -> %s", self.name, before.value, state.value)

    # -- start and stop -----------------------------------------------------------------------

    async def boot(self) -> float:
        """The first start; raises EngineStartError (the caller stops everything)."""
        async with self._lifecycle:
            if self.engine is not None:
                return 0.0
            return await self._start()

    async def _start(self) -> float:
        self.sleep_asked_at = None  # a new engine: awake, and asked nothing yet
        self._set(ModelState.STARTING)
        launch = self.hooks.launch(self.config)
        logger.info("%s: starting its engine on port %d (log %s)", self.name, launch.port,
                    launch.log_path)  # fmt: skip
        engine = await EngineProcess.start(launch)
        self.engine = engine
        try:
            seconds = await engine.wait_healthy(self.hooks.session, START_TIMEOUT_S)
            await asyncio.to_thread(engine.note_shared_memory)
            await self.hooks.engine_ready(self.name)
        except BaseException as exc:
            await engine.stop(timeout=10)
            self.engine = None
            if isinstance(exc, asyncio.CancelledError):  # serve is stopping
                self.stopped_on_exit.append(engine.pid)
                logger.info("%s: start cancelled: engine pid %d stopped", self.name, engine.pid)
            raise
        self.last_start_s = seconds
        self.last_active = time.monotonic()
        self.failures_in_row = 0
        self._monitor = asyncio.get_running_loop().create_task(self._watch(engine))
        self._set(ModelState.SERVING if self.in_flight else ModelState.IDLE)
        logger.info("%s: engine pid %d healthy in %.1f s", self.name, engine.pid, seconds)
        return seconds

    async def stop(self, *, final: bool = False) -> None:
        """Stop the engine (tier 2, or ``serve`` shutting down when ``final``: a start, wake
        or restart in progress is cancelled first, which stops the engine it started)."""
        if final:
            self._closing = True
            pending = [t for t in (self._wake, self._monitor) if t is not None and not t.done()]
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        async with self._lifecycle:
            engine, self.engine = self.engine, None
            if not final:
                self._set(ModelState.STOPPED)
            if engine is not None:
                await engine.stop()
                if final:
                    self.stopped_on_exit.append(engine.pid)
                logger.info("%s: engine pid %d stopped", self.name, engine.pid)

    def retire(self) -> None:
        """The model is being removed: no request is admitted from now on, and those waiting
        for it (a wake) are refused at once."""
        self.removed = True
        self._ready.set()

    def kill(self) -> None:
        """Synchronous last resort at exit: SIGKILL the engine's processes."""
        self._closing = True
        if self.engine is not None:
            self.engine.kill()

    async def _watch(self, engine: EngineProcess) -> None:
        code = await engine.proc.wait()
        if engine.stopping or self._closing or engine is not self.engine:
            return
        engine.kill()  # its engine core and worker too, at once: their memory returns now
        self.engine = None
        self.restarts += 1
        self.last_error = f"engine exited with status {code}"
        logger.warning("%s: engine pid %d exited unexpectedly (status %s); restarting",
                       self.name, engine.pid, code)  # fmt: skip
        self._set(ModelState.STARTING)
        async with self._lifecycle:
            await self._restart_with_backoff()

    async def _restart_with_backoff(self) -> None:
        while not self._closing:
            delay = BACKOFF_S[min(self.failures_in_row, len(BACKOFF_S) - 1)]
            if self.failures_in_row:
                await asyncio.sleep(delay)
            try:
                await self._start()
                return
            except EngineStartError as exc:
                self.failures_in_row += 1
                self.last_error = str(exc).splitlines()[0]
                logger.error("%s: restart %d failed: %s", self.name, self.failures_in_row, exc)
                if self.failures_in_row >= MAX_RESTARTS:
                    self._set(ModelState.FAILED)
                    return
                self._set(ModelState.STARTING)

    # -- requests -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[float]:
        """Hold the model for one request; yields the seconds it waited (queue or wake).
        Raises :class:`Unavailable` when it cannot be served."""
        started = time.monotonic()
        await self._admit()
        self.in_flight += 1
        self._set(ModelState.SERVING)
        try:
            yield time.monotonic() - started
        finally:
            self.in_flight -= 1
            self.last_active = time.monotonic()
            if self.in_flight == 0 and self.state is ModelState.SERVING:
                self._set(ModelState.IDLE)
            self.hooks.changed()

    def _gone(self) -> Unavailable:
        return Unavailable(404, f"model {self.name!r} was removed from this server")

    async def _admit(self) -> None:
        if self.removed:
            raise self._gone()
        if self.state is ModelState.FAILED:
            raise Unavailable(
                503, f"model {self.name!r} failed and is not being restarted: {self.last_error}"
            )
        if self.sleep_asked_at is not None:
            # Withdrawn before the request is forwarded: the engine does not fall asleep
            # again, and one that sleeps wakes on the request's step.
            self.sleep_asked_at = None
            self.hooks.request_sleep(self.name, False)
        if self.state in (ModelState.KV_RELEASED, ModelState.ASLEEP):
            began = time.monotonic()
            await self.hooks.restore_kv(self.name)
            self.hooks.woke(self.name, "kv", time.monotonic() - began)
            return
        if self.state in (ModelState.SERVING, ModelState.IDLE):
            return
        if self.waiting >= self.queue_limit:
            retry = max(1.0, self.last_start_s or 10.0)
            raise Unavailable(
                429,
                f"model {self.name!r} is {self.state.value} and {self.waiting} requests are "
                f"already waiting for it (queue_limit {self.queue_limit}); retry later",
                retry_after=retry,
            )
        self.waiting += 1
        self.hooks.changed()
        try:
            if self.state is ModelState.STOPPED and self._wake is None:
                self._wake = asyncio.get_running_loop().create_task(self._wake_engine())
            try:
                await asyncio.wait_for(self._ready.wait(), self.wake_timeout_s)
            except TimeoutError:
                raise Unavailable(
                    503,
                    f"model {self.name!r} did not become ready within {self.wake_timeout_s:.0f} s "
                    f"(state {self.state.value})",
                    retry_after=10.0,
                ) from None
            if self.removed:
                raise self._gone()
            if self.current() is ModelState.FAILED:  # set while this request waited
                raise Unavailable(503, f"model {self.name!r} failed to start: {self.last_error}")
        finally:
            self.waiting -= 1

    async def _wake_engine(self) -> None:
        began = time.monotonic()
        try:
            async with self._lifecycle:
                if self.state is not ModelState.STOPPED:
                    return
                try:
                    await self._start()
                except EngineStartError as exc:
                    self.failures_in_row += 1
                    self.last_error = str(exc).splitlines()[0]
                    logger.error("%s: wake failed: %s", self.name, exc)
                    self._set(ModelState.FAILED)
                    self._ready.set()  # waiters see FAILED
                    return
            self.hooks.woke(self.name, "engine", time.monotonic() - began)
        finally:
            self._wake = None

    # -- idle policy --------------------------------------------------------------------------

    async def apply_idle_policy(self, now: float) -> None:
        """Tier 1 after ``release_after`` idle, tier 2 after ``sleep_after``, tier 3 after
        ``stop_after`` (unless pinned)."""
        if self.in_flight or self.waiting or self._lifecycle.locked():
            return
        idle_for = now - self.last_active
        stop_after = self.config.stop_after_s
        if (
            self.state in (ModelState.IDLE, ModelState.KV_RELEASED, ModelState.ASLEEP)
            and not self.config.pinned
            and stop_after is not None
            and idle_for >= stop_after
        ):
            logger.info("%s: idle for %.0f s: stopping its engine", self.name, idle_for)
            await self.stop()
            return
        if self.sleep_asked_at is not None:
            self._read_sleep_answer(now)
            return
        sleep_after = self.config.sleep_after_s
        if (
            self.state in (ModelState.IDLE, ModelState.KV_RELEASED)
            and sleep_after is not None
            and self.sleep_refused is None
            and idle_for >= sleep_after
        ):
            if self.state is ModelState.IDLE:
                await self.hooks.release_kv(self.name)
                self._set(ModelState.KV_RELEASED)
            logger.info("%s: idle for %.0f s: putting its weights to sleep", self.name, idle_for)
            self.sleep_asked_at = now
            self.hooks.request_sleep(self.name, True)
            return
        release_after = self.config.release_after_s
        if (
            self.state is ModelState.IDLE
            and release_after is not None
            and idle_for >= release_after
        ):
            logger.info("%s: idle for %.0f s: releasing its KV memory", self.name, idle_for)
            await self.hooks.release_kv(self.name)  # lowered before the state says it is
            self._set(ModelState.KV_RELEASED)

    def _read_sleep_answer(self, now: float) -> None:
        """The engine's answer to the sleep asked at ``sleep_asked_at``."""
        assert self.sleep_asked_at is not None
        answer = self.hooks.sleep_answer(self.name)
        if answer == "asleep":
            if self.state is ModelState.KV_RELEASED:
                self._set(ModelState.ASLEEP)
            return
        if self.state is ModelState.ASLEEP and answer is None:
            return  # a step reached it another way: awake for that step, asleep again after
        waited = now - self.sleep_asked_at
        if answer is None and waited < SLEEP_ANSWER_S:
            return
        why = (
            "its engine cannot release its weights (see the engine's log)"
            if answer == "refused"
            else f"its engine did not answer within {waited:.0f} s"
        )
        self.sleep_refused = why
        self.sleep_asked_at = None
        self.hooks.request_sleep(self.name, False)
        logger.warning(
            "%s: cannot sleep: %s; it stays kv-released until stop_after", self.name, why
        )
