"""The ledger as an allocator capacity policy: a ``BlockAllocator`` built with
``LedgerPolicy(handle)`` admits every page commit through the device ledger, unchanged."""

from __future__ import annotations

from elastickv.alloc.policy import CapacityPolicy
from elastickv.control.info import InstanceInfo
from elastickv.control.ledger import InstanceHandle


class LedgerPolicy(CapacityPolicy):
    """Admission through an instance's ledger record (thread-safe, cross-process)."""

    def __init__(self, handle: InstanceHandle) -> None:
        self._handle = handle

    @property
    def handle(self) -> InstanceHandle:
        return self._handle

    def try_admit(self, nbytes: int) -> bool:
        return self._handle.try_admit(nbytes)

    def release(self, nbytes: int) -> None:
        self._handle.release(nbytes)

    @property
    def admitted_bytes(self) -> int:
        return self._handle.committed_bytes

    def available_bytes(self) -> int:
        return self._handle.available_bytes()

    def set_reserved_bytes(self, nbytes: int) -> bool:
        """Claim the hot reserve in the ledger (see ``InstanceHandle.set_reserved_bytes``)."""
        return self._handle.set_reserved_bytes(nbytes)

    def info(self) -> InstanceInfo:
        """The instance's limit state; ``over_limit_bytes > 0`` asks the owner to trim."""
        return self._handle.info()
