"""Capacity policies: who may grow physical memory, and by how much.

An allocator asks its policy before every commit and tells it after every release, so the
policy's admitted bytes always equal what its allocators have committed. One policy may be
shared by several allocators (and other users of memory) so they compete for one budget; the
cross-process ledger implements the same interface.
"""

from __future__ import annotations

import abc
import threading


class CapacityPolicy(abc.ABC):
    """Admission of physical bytes. Implementations must be thread-safe."""

    @abc.abstractmethod
    def try_admit(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` before committing them; False means "not now" (nothing reserved)."""

    @abc.abstractmethod
    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` that were admitted and are now released (or never committed)."""

    @property
    @abc.abstractmethod
    def admitted_bytes(self) -> int:
        """Bytes admitted and not yet released."""

    @abc.abstractmethod
    def available_bytes(self) -> int:
        """Bytes that could be admitted now (a snapshot; may be stale by the time it is used)."""


class Unlimited(CapacityPolicy):
    """Admit everything; still counts, so the accounting can be checked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._admitted = 0

    def try_admit(self, nbytes: int) -> bool:
        _check(nbytes)
        with self._lock:
            self._admitted += nbytes
        return True

    def release(self, nbytes: int) -> None:
        _check(nbytes)
        with self._lock:
            if nbytes > self._admitted:
                raise ValueError(f"releasing {nbytes} bytes but only {self._admitted} admitted")
            self._admitted -= nbytes

    @property
    def admitted_bytes(self) -> int:
        return self._admitted

    def available_bytes(self) -> int:
        return 1 << 62


class FixedBudget(CapacityPolicy):
    """A local byte budget. Lowering the limit below what is admitted is lazy: nothing is taken
    back, growth is refused until enough is released."""

    def __init__(self, limit_bytes: int) -> None:
        _check(limit_bytes)
        self._lock = threading.Lock()
        self._limit = limit_bytes
        self._admitted = 0

    @property
    def limit_bytes(self) -> int:
        return self._limit

    def set_limit(self, limit_bytes: int) -> None:
        _check(limit_bytes)
        with self._lock:
            self._limit = limit_bytes

    def try_admit(self, nbytes: int) -> bool:
        _check(nbytes)
        with self._lock:
            if self._admitted + nbytes > self._limit:
                return False
            self._admitted += nbytes
            return True

    def release(self, nbytes: int) -> None:
        _check(nbytes)
        with self._lock:
            if nbytes > self._admitted:
                raise ValueError(f"releasing {nbytes} bytes but only {self._admitted} admitted")
            self._admitted -= nbytes

    @property
    def admitted_bytes(self) -> int:
        return self._admitted

    def available_bytes(self) -> int:
        return max(0, self._limit - self._admitted)


def _check(nbytes: int) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"byte counts must be non-negative ints, got {nbytes!r}")
