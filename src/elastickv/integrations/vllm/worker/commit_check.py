"""An optional guard (``ELASTICKV_CHECK_COMMITS=1``) that proves the commit-before-forward order.

The scheduler commits a block's pages (``fallocate``) inside ``allocate_slots``, before it
returns the step's ``SchedulerOutput``; the worker only receives that output afterwards, and
the engine core frees blocks only after the forward returned. So while a forward runs, the
pool's allocated size must not change — unless the forward touches a page that was never
committed, which the kernel then allocates on the spot (a write or a read through a shared
shmem mapping allocates). The guard compares the memfd's ``st_blocks`` before and after
every ``execute_model``: kernel-measured, covering every page, not just the new blocks.

Why this matters most in multiprocess mode: the worker maps the whole pool, so a write to an
uncommitted page would not fault there; without the guard an ordering bug would only show
as footprint drift. (``SEEK_DATA``/``mincore`` cannot serve: shmem reports fallocated but
never written pages as holes.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


class CommitOrderError(RuntimeError):
    """A forward touched KV pages the scheduler had not committed before it."""


class CommitCheck:
    """Runs a forward and fails if the pool behind ``fd`` grew while it ran."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.forwards = 0

    def allocated_bytes(self) -> int:
        return os.fstat(self._fd).st_blocks * 512

    def run(self, forward: Callable[[], _T]) -> _T:
        before = self.allocated_bytes()
        result = forward()
        grown = self.allocated_bytes() - before
        if grown:
            raise CommitOrderError(
                f"the forward touched {grown} bytes of KV pages that were not committed "
                "before it (the scheduler must commit blocks before the step that writes them)"
            )
        self.forwards += 1
        return result
