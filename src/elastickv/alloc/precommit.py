"""The optional background thread that keeps the hot reserve topped up.

Committing a page costs milliseconds (kernel zeroing, driver mapping); doing it ahead of time
takes it off the scheduler's path. The thread is owned by one allocator, bounded (it never
commits past ``max_hot_pages`` or the policy) and stoppable; it only calls the allocator's own
:meth:`~elastickv.alloc.allocator.BlockAllocator.precommit`, never user callbacks.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastickv.alloc.allocator import BlockAllocator


class PrecommitThread:
    """Wakes when the reserve runs low (or every ``interval_s``) and tops it up."""

    def __init__(self, allocator: BlockAllocator, *, interval_s: float = 0.05) -> None:
        self._allocator = allocator
        self._interval = interval_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0
        self.pages_committed = 0
        self.last_error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the pre-commit thread was already started")
        self._thread = threading.Thread(target=self._run, name="elastickv-precommit", daemon=True)
        self._thread.start()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the thread to finish and wait for it. Idempotent."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                raise RuntimeError("the pre-commit thread did not stop in time")

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.pages_committed += self._allocator.precommit()
            except Exception as exc:  # keep serving; the error is visible on the thread object
                self.last_error = exc
            self.rounds += 1
