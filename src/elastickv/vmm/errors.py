"""Errors raised by the virtual-memory backends.

Every error says what failed and what the caller can do about it. System-call failures keep the
``errno`` so callers can tell "out of memory" from "bad argument" without parsing messages.
"""

from __future__ import annotations

import errno as _errno
import os


class VmmError(Exception):
    """Base class of every error raised by :mod:`elastickv.vmm`."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class BackendUnavailable(VmmError):
    """The backend cannot run here (wrong OS, missing driver or library)."""


class PageSizeError(VmmError, ValueError):
    """The requested page size is not a positive multiple of the backend's granularity."""


class PageIndexError(VmmError, IndexError):
    """A page index is outside the reserved range."""


class ReservationError(VmmError):
    """Reserving virtual address space (or the physical pool behind it) failed."""


class CommitError(VmmError):
    """Making physical memory present under pages failed; nothing of that call stays committed."""


class OutOfPhysicalMemory(CommitError):
    """The system (or the cgroup) has no physical memory left for the pages asked for."""


class ReleaseError(VmmError):
    """Returning pages to the system failed; the pages that failed are still committed."""


class DeviceFault(VmmError):
    """The device context is lost after an illegal access or another sticky fault.

    On CUDA such a fault (e.g. a kernel touching an uncommitted page of a strict range) poisons
    the process's context: every later driver call fails with the same error, so no commit or
    release can succeed again. Only a new process recovers.
    """


class RangeClosedError(VmmError):
    """The range (or pool) was closed; it cannot be used any more."""


def describe_errno(code: int) -> str:
    """``ENOMEM (Cannot allocate memory)`` style text for messages."""
    name = _errno.errorcode.get(code, f"errno {code}")
    return f"{name} ({os.strerror(code)})"
