"""The engine core's two guards, without vLLM: the parent watchdog (real processes) and the
idle ticks on a real ``queue.Queue`` (the real engine core is in
tests/integration_vllm/test_vllm_plugin_v032_serve.py)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil

from elastickv.integrations.vllm.engine.idle_ticks import IdleTickQueue, tick_while_idle

# A parent that starts a child running the watchdog, prints the child's pid, then waits.
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
time.sleep(600)
"""


def test_watchdog_stops_the_process_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    child = psutil.Process(child_pid)
    time.sleep(0.5)
    assert child.is_running()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    started = time.monotonic()
    gone, _ = psutil.wait_procs([child], timeout=10)
    assert gone, "the orphan kept running"
    assert time.monotonic() - started < 5


def test_watchdog_leaves_a_process_whose_parent_lives() -> None:
    from elastickv.integrations.vllm.engine.watchdog import ParentWatchdog

    watchdog = ParentWatchdog(os.getppid(), interval=0.01).start()
    time.sleep(0.1)
    assert watchdog.parent_alive()
    watchdog.stop()


def test_idle_ticks_run_in_the_waiting_thread_and_keep_the_queue() -> None:
    q: queue.Queue[int] = queue.Queue()
    q.put(1)
    ticks: list[str] = []
    assert tick_while_idle(q, lambda: ticks.append(threading.current_thread().name), 0.02)
    assert isinstance(q, IdleTickQueue)
    assert q.get() == 1  # the contents survived
    threading.Timer(0.2, lambda: q.put_nowait(2)).start()
    assert q.get() == 2  # a blocking get still returns what another thread puts
    assert len(ticks) >= 3 and set(ticks) == {threading.current_thread().name}
    # A failing idle chore is logged, never raised into the engine loop.
    q.on_idle = lambda: 1 / 0
    threading.Timer(0.1, lambda: q.put_nowait(3)).start()
    assert q.get() == 3


def test_only_plain_queues_are_changed() -> None:
    class Other(queue.Queue):  # type: ignore[type-arg]
        pass

    assert not tick_while_idle(Other(), lambda: None)
    assert not tick_while_idle(object(), lambda: None)
