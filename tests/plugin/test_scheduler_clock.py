"""The scheduler clock (``ELASTICKV_SCHEDULER_CLOCK``): a scheduler class's two step methods,
as they are when it is installed (hooks included), counted in CPU time and calls into an
owner-only file that another process reads."""

from __future__ import annotations

import stat
import time
from pathlib import Path
from typing import Any

import pytest

from elastickv.integrations.vllm.scheduler.scheduler_clock import (
    SchedulerTimes,
    clock_file_from_env,
    clock_methods,
    create_clock_file,
    open_clock_file,
    read_clock,
)


def busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def make_scheduler() -> type:
    class Scheduler:
        def schedule(self, seconds: float) -> str:
            busy(seconds)
            return "planned"

        def update_from_output(self, fail: bool = False) -> str:
            if fail:
                raise RuntimeError("the step failed")
            return "updated"

    return Scheduler


def test_the_file_is_owner_only_zeroed_and_never_shared(tmp_path: Path) -> None:
    path = tmp_path / "clock"
    create_clock_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_clock(path) == SchedulerTimes()
    with pytest.raises(FileExistsError):
        create_clock_file(path)  # a second engine must not count into the same file
    (tmp_path / "other").write_bytes(b"not a clock")
    with pytest.raises(ValueError, match="not a scheduler clock file"):
        read_clock(tmp_path / "other")


def test_cpu_time_and_calls_of_each_method_reach_the_file(tmp_path: Path) -> None:
    path = tmp_path / "clock"
    create_clock_file(path)
    scheduler_class = make_scheduler()
    assert clock_methods(scheduler_class, path)
    scheduler: Any = scheduler_class()
    before = read_clock(path)
    for _ in range(3):
        assert scheduler.schedule(0.01) == "planned"
    assert scheduler.update_from_output() == "updated"
    with pytest.raises(RuntimeError, match="the step failed"):
        scheduler.update_from_output(fail=True)  # counted, and the error goes through
    counted = read_clock(path) - before
    assert counted.schedule_calls == 3 and counted.update_calls == 2
    assert 0.03 <= counted.schedule_ns / 1e9 < 1.0  # CPU time spent in the method
    assert counted.update_ns < counted.schedule_ns
    assert counted.cpu_s == (counted.schedule_ns + counted.update_ns) / 1e9


def test_it_wraps_the_methods_as_they_are_and_only_once(tmp_path: Path) -> None:
    """Installed after elastickv's hooks, the clock counts them: it calls whatever the class
    holds when it is installed. A second install in the same process changes nothing."""
    scheduler_class = make_scheduler()
    hooked: list[str] = []
    inner = scheduler_class.schedule  # type: ignore[attr-defined]

    def hook(self: Any, seconds: float) -> str:
        hooked.append("hook")
        return inner(self, seconds)  # type: ignore[no-any-return]

    scheduler_class.schedule = hook  # type: ignore[attr-defined]
    path = tmp_path / "clock"
    assert clock_methods(scheduler_class, path)  # creates the file at its first write
    assert not clock_methods(scheduler_class, tmp_path / "second")
    scheduler: Any = scheduler_class()
    scheduler.schedule(0.0)
    assert hooked == ["hook"]
    assert read_clock(path).schedule_calls == 1
    assert not (tmp_path / "second").exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_variable_names_the_file() -> None:
    assert clock_file_from_env({}) is None
    assert clock_file_from_env({"ELASTICKV_SCHEDULER_CLOCK": " "}) is None
    assert clock_file_from_env({"ELASTICKV_SCHEDULER_CLOCK": "/run/x.clock"}) == Path(
        "/run/x.clock"
    )


def test_a_file_that_is_not_a_clock_is_refused_and_left_alone(tmp_path: Path) -> None:
    """A mistyped path must not be overwritten: another file, a link or a missing folder is
    refused with what is wrong; once an engine runs, a clock that cannot write stops
    counting instead of stopping the engine."""
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"precious data, longer than thirty-two bytes")
    with pytest.raises(ValueError, match="not a scheduler clock file"):
        open_clock_file(notes)
    link = tmp_path / "link.clock"
    link.symlink_to(tmp_path / "target.clock")
    with pytest.raises(ValueError, match="a link is refused"):
        open_clock_file(link)
    with pytest.raises(ValueError, match="cannot be opened"):
        open_clock_file(tmp_path / "missing" / "x.clock")
    scheduler_class = make_scheduler()
    assert clock_methods(scheduler_class, notes)
    scheduler: Any = scheduler_class()
    assert scheduler.schedule(0.0) == "planned" and scheduler.schedule(0.0) == "planned"
    assert notes.read_bytes() == b"precious data, longer than thirty-two bytes"
    assert not (tmp_path / "target.clock").exists()
