"""Credit: room an instance takes in its ledger ahead of demand, so that admission is local.

Why: an engine's scheduler decides whether a request fits from a free-block count and then
allocates unconditionally, many times per step. Asking the ledger each time (a lock round
trip) is too slow, and answering from a cached view of free memory races with every other
engine under the same budget. With credit, the engine holds room in its ledger record
(counted by its limit and the device budget as *reserved*), so its free-block count is exact
and local and an admission inside the credit cannot be refused later. The ledger is asked
once per scheduler step at most, to move credit with demand (:meth:`CreditPolicy.settle`).

Invariant: the record holds ``committed + credit`` of this engine at all times. Turning credit
into committed pages, or a released page back into credit, leaves that sum as it is, so those
happen locally; only growing it takes the ledger's lock, and it only grows when it fits.
"""

from __future__ import annotations

import threading

from elastickv.alloc.policy import CapacityPolicy
from elastickv.control.info import InstanceInfo
from elastickv.control.ledger import InstanceHandle


class CreditPolicy(CapacityPolicy):
    """An allocator capacity policy that admits page commits from credit only."""

    def __init__(self, handle: InstanceHandle) -> None:
        self._handle = handle
        self._lock = threading.Lock()
        self._committed = 0
        self._credit = 0
        self.refusals = 0  # commits refused for want of credit (vLLM waited or preempted)

    @property
    def handle(self) -> InstanceHandle:
        return self._handle

    def try_admit(self, nbytes: int) -> bool:
        """Take ``nbytes`` from the credit. Short of credit, ask the ledger for it (a lock
        round trip: the null block's pages at start-up; an engine's scheduler counts its
        free blocks from the credit and never gets here otherwise)."""
        with self._lock:
            if nbytes > self._credit:
                if not self._handle.closed:
                    self._credit = self._handle.settle(self._committed, nbytes)
                if nbytes > self._credit:
                    self.refusals += 1
                    return False
            self._credit -= nbytes
            self._committed += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            if nbytes > self._committed:
                raise ValueError(
                    f"releasing {nbytes} bytes but only {self._committed} are committed"
                )
            self._committed -= nbytes
            self._credit += nbytes

    @property
    def admitted_bytes(self) -> int:
        return self._committed

    @property
    def credit_bytes(self) -> int:
        return self._credit

    def available_bytes(self) -> int:
        """The credit: what commits can take now without asking the ledger."""
        return self._credit

    def settle(self, credit: int) -> int:
        """Publish the committed bytes to the ledger and hold ``credit`` bytes of credit (or
        as much as the limit and the device budget allow now); returns the credit held."""
        with self._lock:
            if self._handle.closed:
                return self._credit
            self._credit = self._handle.settle(self._committed, credit)
            return self._credit

    def limit_allows(self, credit: int) -> bool:
        """Whether ``credit`` more bytes than committed now may fit the limit the ledger last
        showed (see :meth:`InstanceHandle.limit_allows`); no lock round trip."""
        return self._handle.limit_allows(self._committed + credit)

    def limit_room(self, max_age_ns: int | None = None) -> int | None:
        """The most credit the limit the ledger last showed leaves beyond the committed bytes
        (see :meth:`InstanceHandle.limit_room`, and its ``max_age_ns``); None when only the
        ledger can say."""
        return self._handle.limit_room(self._committed, max_age_ns)

    def over_limit_bytes(self) -> int:
        """How much this engine holds (committed and credit) above its live limit."""
        if self._handle.closed:
            return 0
        return self._handle.over_limit_bytes()

    def info(self) -> InstanceInfo:
        return self._handle.info()
