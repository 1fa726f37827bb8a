"""The engine core's two guards, without vLLM: the parent watchdog (real processes) and the
idle ticks on a real ``queue.Queue`` (the real engine core is in
tests/integration_vllm/test_vllm_plugin_v032_serve.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from elastickv.integrations.vllm.engine.idle_ticks import IdleTickQueue, tick_while_idle

# A parent that starts a child running the watchdog, prints the child's pid, then waits. The
# child shares the parent's stdout: it says when its watchdog watches, and when SIGTERM came.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(600)
"""
CHILD = """
import os, signal, sys, time
from elastickv.integrations.vllm.engine.watchdog import ParentWatchdog
def on_term(*_):
    print("SIGTERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
ParentWatchdog(os.getppid(), interval=0.05).start()
print("watching", flush=True)
time.sleep(600)
"""
# Only against a hang: the watchdog notices within its 0.05 s interval, and with SIGTERM
# handled the child exits at once; its 10 s grace (a SIGKILL) would show as no "SIGTERM" line.
HANG_S = 120


def test_watchdog_stops_the_process_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        # The parent dies only once the child's watchdog watches it (a kill before would
        # leave the child watching the process it was re-parented to).
        assert parent.stdout.readline().strip() == "watching"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        # The watchdog asked the way vLLM's shutdown is asked: SIGTERM, then the pipe ends.
        assert parent.stdout.readline().strip() == "SIGTERM", "the orphan was not asked to stop"
        gone, _ = psutil.wait_procs([child], timeout=HANG_S)
        assert gone, "the orphan kept running"
        assert parent.stdout.read() == ""
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


# An orphan whose shutdown never lets a Python thread run again: its SIGTERM handler calls
# C's sleep holding the GIL (``PyDLL`` does not release it), as an interpreter finalising or
# a C destructor would. It started a process of its own first (a worker, in vLLM).
CHILD_STUCK = """
import ctypes, os, signal, subprocess, sys, time
from elastickv.integrations.vllm.engine.watchdog import ParentWatchdog
def on_term(*_):
    print("SIGTERM", flush=True)
    ctypes.PyDLL(None).sleep(600)
signal.signal(signal.SIGTERM, on_term)
worker = subprocess.Popen(["sleep", "600"])
ParentWatchdog(os.getppid(), interval=0.05, grace_s=0.5).start()
print(worker.pid, flush=True)
time.sleep(600)
"""


def test_an_orphan_whose_threads_cannot_run_is_killed_with_its_processes() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD_STUCK],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started: list[psutil.Process] = []
    try:
        assert parent.stdout is not None and parent.stderr is not None
        child = psutil.Process(int(parent.stdout.readline()))
        started.append(child)
        worker = psutil.Process(int(parent.stdout.readline()))  # printed once it watches
        started.append(worker)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert parent.stdout.readline().strip() == "SIGTERM"
        # Only the reaper can end them: the handler holds the GIL for 600 s.
        _, alive = psutil.wait_procs([child, worker], timeout=HANG_S)
        assert not alive, "the stuck orphan or its worker kept running"
        reported = parent.stderr.read()
        assert f"the engine core (pid {child.pid}) did not stop in" in reported, reported
        assert "killed it and 1 process(es) under it" in reported, reported
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for process in started:
            with contextlib.suppress(psutil.Error):
                process.kill()


def test_watchdog_leaves_a_process_whose_parent_lives() -> None:
    from elastickv.integrations.vllm.engine.watchdog import ParentWatchdog

    watchdog = ParentWatchdog(os.getppid(), interval=0.01).start()
    time.sleep(0.1)
    assert watchdog.parent_alive()
    watchdog.stop()


def test_idle_ticks_run_in_the_waiting_thread_and_keep_the_queue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    q: queue.Queue[int] = queue.Queue()
    q.put(1)
    ticks: list[str] = []

    def tick() -> None:
        ticks.append(threading.current_thread().name)
        if len(ticks) == 3:  # another thread puts work while the engine waits
            putter = threading.Thread(target=q.put_nowait, args=(2,))
            putter.start()
            putter.join()  # put before the next wait: no fourth tick

    assert tick_while_idle(q, tick, 0.02)
    assert isinstance(q, IdleTickQueue)
    assert q.get() == 1  # the contents survived
    assert q.get() == 2  # a blocking get still returns what another thread puts
    assert len(ticks) == 3 and set(ticks) == {threading.current_thread().name}

    # A failing idle chore is logged, never raised into the engine loop.
    def failing() -> None:
        if not failed:
            failed.append(True)
            q.put_nowait(3)  # the next wait returns this, after the failure
        raise ZeroDivisionError("an idle chore failed")

    failed: list[bool] = []
    q.on_idle = failing
    with caplog.at_level(logging.ERROR):
        assert q.get() == 3
    assert failed and "idle tick failed" in caplog.text


def test_only_plain_queues_are_changed() -> None:
    class Other(queue.Queue):  # type: ignore[type-arg]
        pass

    assert not tick_while_idle(Other(), lambda: None)
    assert not tick_while_idle(object(), lambda: None)


def test_the_reaper_kills_nothing_that_exits_within_the_grace() -> None:
    from elastickv.integrations.vllm.engine.reaper import reap

    # Exited but not yet waited for (a zombie, as an engine core whose parent died is until
    # its new parent reaps it): gone, nothing to kill, no wait for the grace.
    exited = subprocess.Popen(["true"])
    while psutil.Process(exited.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    began = time.monotonic()
    assert reap(exited.pid, HANG_S) == []
    assert time.monotonic() - began < HANG_S
    exited.wait()
    assert reap(exited.pid, HANG_S) == []  # no such process any more
