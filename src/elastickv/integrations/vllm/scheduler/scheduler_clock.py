"""The scheduler's CPU time in an engine core, counted for benchmarks: native vLLM and
elastickv alike (``ELASTICKV_SCHEDULER_CLOCK=FILE``, which works without ``ELASTICKV=1``).

Why: on vLLM's CPU backend the engine core waits for its worker in a busy loop (vLLM's
shared-memory queue calls ``sched_yield`` for 1 s after each read), so the engine core
process's CPU time follows the wall time of the work and how much idle CPU the host has, not
what the scheduler does. This clock counts the CPU time of the engine core's thread inside
``Scheduler.schedule`` and ``Scheduler.update_from_output``, elastickv's scheduler hooks
included (it wraps them), and keeps the totals in FILE for a benchmark to read between its
passes.

FILE holds four little-endian unsigned 64-bit counters, rewritten after each call:
nanoseconds in ``schedule``, its calls, nanoseconds in ``update_from_output``, its calls. The
plugin installs the clock in every vLLM process where the variable is set; only a process
that runs a scheduler writes, and the file is meant for one engine core.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastickv.integrations.vllm.config import SCHEDULER_CLOCK_VAR
from elastickv.integrations.vllm.errors import ElasticKVStartupError

_LAYOUT = struct.Struct("<4Q")
_MARK = "__elastickv_scheduler_clock__"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerTimes:
    """What the clock counted so far: CPU nanoseconds and calls of each method."""

    schedule_ns: int = 0
    schedule_calls: int = 0
    update_ns: int = 0
    update_calls: int = 0

    def __sub__(self, earlier: SchedulerTimes) -> SchedulerTimes:
        return SchedulerTimes(
            self.schedule_ns - earlier.schedule_ns,
            self.schedule_calls - earlier.schedule_calls,
            self.update_ns - earlier.update_ns,
            self.update_calls - earlier.update_calls,
        )

    @property
    def cpu_s(self) -> float:
        """CPU seconds in both methods."""
        return (self.schedule_ns + self.update_ns) / 1e9


def clock_file_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """The clock's file if ``ELASTICKV_SCHEDULER_CLOCK`` is set (non-empty), else None."""
    value = (os.environ if environ is None else environ).get(SCHEDULER_CLOCK_VAR, "").strip()
    return Path(value) if value else None


def create_clock_file(path: Path) -> None:
    """A zeroed clock file, readable and writable by its owner only; refuses an existing one
    (two engines must not count into one file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, bytes(_LAYOUT.size))
    finally:
        os.close(fd)


def open_clock_file(path: Path) -> mmap.mmap:
    """``path`` mapped for writing the counters: a clock file (created if missing) owned by
    this user and not a link; ValueError, saying what is wrong, for anything else (a file
    the clock would overwrite)."""
    try:
        with contextlib.suppress(FileExistsError):
            create_clock_file(path)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        why = "a link is refused" if exc.errno == errno.ELOOP else exc.strerror
        raise ValueError(f"{SCHEDULER_CLOCK_VAR}={path} cannot be opened: {why}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != _LAYOUT.size:
            raise ValueError(
                f"{SCHEDULER_CLOCK_VAR}={path} is not a scheduler clock file "
                f"({st.st_size} bytes); name a new file, which is created"
            )
        if st.st_uid != os.getuid():
            raise ValueError(f"{SCHEDULER_CLOCK_VAR}={path} belongs to another user")
        return mmap.mmap(fd, _LAYOUT.size)
    finally:
        os.close(fd)


def read_clock(path: Path) -> SchedulerTimes:
    """The counters in ``path``; all zero until a scheduler ran."""
    data = path.read_bytes()
    if len(data) != _LAYOUT.size:
        raise ValueError(f"{path} is not a scheduler clock file ({len(data)} bytes)")
    return SchedulerTimes(*_LAYOUT.unpack(data))


class _Counters:
    """The process's totals, mirrored into the file (mapped at the first call: only a
    process that runs a scheduler writes). A clock must never stop an engine: if the file
    cannot be mapped then, the clock logs why and counts no more."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.values = [0, 0, 0, 0]
        self._view: mmap.mmap | None = None
        self.failed = False

    def add(self, slot: int, ns: int) -> None:
        values = self.values
        values[slot] += ns
        values[slot + 1] += 1
        view = self._view
        if view is None:
            if self.failed:
                return
            try:
                view = self._view = open_clock_file(self.path)
            except (OSError, ValueError) as exc:
                self.failed = True
                logger.warning("elastickv: the scheduler clock stopped: %s", exc)
                return
        _LAYOUT.pack_into(view, 0, *values)


def clock_methods(scheduler_class: type, path: Path) -> bool:
    """Wrap ``schedule`` and ``update_from_output`` of ``scheduler_class`` (as they are now,
    hooks included) with the clock; False if this process did so already."""
    if getattr(scheduler_class.schedule, _MARK, False):  # type: ignore[attr-defined]
        return False
    counters = _Counters(path)
    for name, slot in (("schedule", 0), ("update_from_output", 2)):
        setattr(scheduler_class, name, _clocked(getattr(scheduler_class, name), counters, slot))
    return True


def _clocked(method: Callable[..., Any], counters: _Counters, slot: int) -> Callable[..., Any]:
    clock = time.thread_time_ns

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            counters.add(slot, clock() - start)

    setattr(timed, _MARK, True)
    return timed


def install(path: Path) -> bool:
    """Clock vLLM's ``Scheduler`` in this process (after elastickv's own hooks, so that they
    are counted); False if it was already. A path that is not a clock file this user may
    write is refused here, at start-up."""
    from vllm.v1.core.sched.scheduler import Scheduler

    try:
        open_clock_file(path).close()
    except ValueError as exc:
        raise ElasticKVStartupError(str(exc)) from None
    return clock_methods(Scheduler, path)
