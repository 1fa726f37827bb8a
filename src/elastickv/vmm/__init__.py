"""Virtual memory backends: reserve a large range, commit and release physical pages under it.

The host backend (Linux memfd + mmap) is imported eagerly; it needs nothing beyond the standard
library. A CUDA backend plugs into the same :class:`VmmBackend` / :class:`VirtualRange` interface.
"""

from elastickv.vmm.base import (
    DEFAULT_PAGE_SIZE,
    RangeInfo,
    VirtualRange,
    VmmBackend,
    page_runs,
    round_up,
    validate_page_size,
)
from elastickv.vmm.errors import (
    BackendUnavailable,
    CommitError,
    DeviceFault,
    OutOfPhysicalMemory,
    PageIndexError,
    PageSizeError,
    RangeClosedError,
    ReleaseError,
    ReservationError,
    VmmError,
)
from elastickv.vmm.host import HostBackend, HostPool, HostRange, host_granularity

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "BackendUnavailable",
    "CommitError",
    "DeviceFault",
    "HostBackend",
    "HostPool",
    "HostRange",
    "OutOfPhysicalMemory",
    "PageIndexError",
    "PageSizeError",
    "RangeClosedError",
    "RangeInfo",
    "ReleaseError",
    "ReservationError",
    "VirtualRange",
    "VmmBackend",
    "VmmError",
    "host_granularity",
    "page_runs",
    "round_up",
    "validate_page_size",
]
