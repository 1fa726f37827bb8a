"""Kills an orphaned engine core, and every process under it, that outlives its grace.

The parent watchdog asks an orphaned engine core to stop through vLLM's own SIGTERM path.
Its promise, that the engine is gone ``grace_s`` later whatever that path does, cannot rest
on a thread of the same process: once the interpreter is finalising (daemon threads are
frozen), or while a C call holds the GIL, no Python thread of it runs. So the watchdog starts
this small process, which outlives the engine core if need be: it waits until every process
of the engine is gone or the grace has passed, then kills what is left.

Usage (the watchdog's): ``python -m elastickv.integrations.vllm.engine.reaper PID GRACE_S``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import psutil

POLL_S = 0.1


def family(process: psutil.Process) -> set[psutil.Process]:
    """``process`` and its descendants as far as they can still be read, less this process
    (the engine core's child too)."""
    found = {process}
    with contextlib.suppress(psutil.Error):
        found.update(process.children(recursive=True))
    return {p for p in found if p.pid != os.getpid()}


def running(process: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap(pid: int, grace_s: float, poll_s: float = POLL_S) -> list[int]:
    """Wait up to ``grace_s`` for ``pid`` and its descendants to exit; kill those left (a
    process is identified with its start time, so a reused pid is never killed). Returns the
    pids killed."""
    try:
        engine = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    watched = family(engine)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        watched = {p for p in watched if running(p)}
        if not watched:
            return []
        if running(engine):
            watched |= family(engine)  # a process started since is one of the engine's too
        time.sleep(poll_s)
    if running(engine):
        watched |= family(engine)
    watched = {p for p in watched if running(p)}
    killed = []
    # The engine core first: it cannot restart a worker once it is stopped.
    for process in sorted(watched, key=lambda p: p.pid != pid):
        with contextlib.suppress(psutil.Error):
            process.kill()
            killed.append(process.pid)
    return killed


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: python -m elastickv.integrations.vllm.engine.reaper PID GRACE_S",
            file=sys.stderr,
        )
        return 2
    pid, grace_s = int(argv[0]), float(argv[1])
    killed = reap(pid, grace_s)
    if killed:
        print(
            f"elastickv: the engine core (pid {pid}) did not stop in {grace_s:g} s after its "
            f"parent died; killed it and {len(killed) - 1} process(es) under it",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
