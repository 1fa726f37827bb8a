"""The engine core exits when the process that started it is gone.

vLLM's API server starts the engine core as a child; killed with ``kill -9`` it cannot stop
it, and the orphaned engine core (and its worker) would keep running and keep its committed
KV memory forever. :class:`ParentWatchdog` notices the parent's death (the process is
reparented) within ``interval`` seconds and asks the engine core to stop the way a SIGTERM
does, so vLLM shuts down cleanly and the scheduler unregisters from the ledger; if that does
not finish within ``grace_s``, a small process it started first (:mod:`.reaper`) kills the
engine core and every process under it. Not a thread of its own: no thread of a process runs
while its interpreter finalises or a C call holds the GIL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading

import psutil

logger = logging.getLogger(__name__)


class ParentWatchdog:
    """A daemon thread owned by one engine-core process; :meth:`stop` ends it."""

    def __init__(self, parent_pid: int, *, interval: float = 0.2, grace_s: float = 10.0) -> None:
        self.parent_pid = parent_pid
        self.interval = interval
        self.grace_s = grace_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="elastickv-parent-watchdog", daemon=True
        )

    def start(self) -> ParentWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def parent_alive(self) -> bool:
        """The parent is alive while this process is still its child (not reparented)."""
        return os.getppid() == self.parent_pid

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.parent_alive():
                self._shut_down()
                return

    def _shut_down(self) -> None:
        logger.warning(
            "elastickv: the parent of this vLLM engine core (pid %d) is gone; shutting the "
            "engine down so its KV memory returns",
            self.parent_pid,
        )
        reaper = self._start_reaper()
        os.kill(os.getpid(), signal.SIGTERM)  # vLLM's own shutdown path
        if reaper is not None or self._stop.wait(self.grace_s):
            return
        # No reaper could start: the same deadline from this thread, while it can run.
        logger.error("elastickv: the engine core did not stop in %.0f s; killing it", self.grace_s)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        os.kill(os.getpid(), signal.SIGKILL)

    def _start_reaper(self) -> subprocess.Popen[bytes] | None:
        command = [sys.executable, "-m", "elastickv.integrations.vllm.engine.reaper"]
        command += [str(os.getpid()), str(self.grace_s)]
        try:
            return subprocess.Popen(command, stdin=subprocess.DEVNULL)
        except OSError as exc:
            logger.error("elastickv: cannot start the engine core's reaper: %s", exc)
            return None
