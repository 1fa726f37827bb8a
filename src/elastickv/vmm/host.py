"""Linux host-memory backend: a ``PROT_NONE`` reservation over a memfd physical pool.

Why this shape:

* The reservation is an anonymous ``PROT_NONE`` mapping. It costs no memory and is not charged
  against overcommit (only writable private mappings are), so 64 GiB reserves anywhere.
* The physical pool is a memfd the size of the reservation. Page ``i`` of the range is always
  backed by bytes ``[i * page_size, (i + 1) * page_size)`` of the memfd, so there is no
  page-table of our own and another process holding the fd sees the same physical pages.
* Commit = ``fallocate`` (mode 0) on the memfd run, so the memory exists and is accounted before
  anything touches it (a shortage is a clean error, not a SIGBUS later), then
  ``mmap(MAP_SHARED | MAP_FIXED)`` of that run over the reservation.
* Release = map the idle protection back over the run (``MAP_FIXED`` anonymous), then
  ``fallocate(PUNCH_HOLE | KEEP_SIZE)`` so the memory really returns to the system.
* Footprint = the memfd's allocated blocks (``st_blocks * 512``), i.e. what the kernel holds.

Strict mode (the default) keeps uncommitted pages ``PROT_NONE``: any stray read or write
faults (SIGSEGV). Strict costs nothing here because the reservation is ``PROT_NONE`` anyway.
Non-strict mode maps uncommitted pages read-only and private: reads return zeros from the
kernel's shared zero page, writes still fault. Uncommitted memory is never writable, so a stray
write can never allocate memory silently or alias another page.

Sharing: physical state (the memfd's blocks) is shared by every process that holds the fd;
mapping state (which pages this process can touch) is per process. ``release`` and ``close``
punch holes, which frees the pages for every holder; a process that only wants to stop viewing
pages calls :meth:`HostRange.unmap`. Coordinating who may release is the caller's job.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import sys
import weakref
from typing import TYPE_CHECKING

from elastickv.vmm.base import (
    DEFAULT_PAGE_SIZE,
    VirtualRange,
    VmmBackend,
    page_runs,
    round_up,
)
from elastickv.vmm.errors import (
    BackendUnavailable,
    CommitError,
    OutOfPhysicalMemory,
    PageIndexError,
    PageSizeError,
    RangeClosedError,
    ReleaseError,
    ReservationError,
    describe_errno,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

PROT_NONE = 0
PROT_READ = mmap.PROT_READ
PROT_WRITE = mmap.PROT_WRITE
MAP_SHARED = mmap.MAP_SHARED
MAP_PRIVATE = mmap.MAP_PRIVATE
MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
MAP_FIXED = 0x10  # the same value on every Linux architecture
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MAP_FAILED = ctypes.c_void_p(-1).value
_OUT_OF_MEMORY = frozenset({errno.ENOSPC, errno.ENOMEM})


class LibC:
    """Typed wrappers over the libc calls the backend needs; failures raise ``OSError``."""

    def __init__(self) -> None:
        if not sys.platform.startswith("linux"):
            raise BackendUnavailable(
                f"the host VMM backend needs Linux (memfd + mmap), not {sys.platform}"
            )
        if ctypes.sizeof(ctypes.c_void_p) != 8:
            raise BackendUnavailable("the host VMM backend needs a 64-bit process")
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            self._mmap = lib.mmap
            self._munmap = lib.munmap
            self._fallocate = lib.fallocate
        except (OSError, AttributeError) as exc:
            raise BackendUnavailable(f"libc lacks mmap/munmap/fallocate: {exc}") from exc
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        self._munmap.restype = ctypes.c_int
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._fallocate.restype = ctypes.c_int
        self._fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]

    def mmap(self, address: int, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
        result = self._mmap(address or None, length, prot, flags, fd, offset)
        if result == MAP_FAILED:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return int(result or 0)

    def munmap(self, address: int, length: int) -> None:
        if self._munmap(address, length) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    def munmap_quietly(self, address: int, length: int) -> None:
        """For finalizers: nothing useful can be done with an error there."""
        self._munmap(address, length)

    def fallocate(self, fd: int, mode: int, offset: int, length: int) -> None:
        while self._fallocate(fd, mode, offset, length) != 0:
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code))


def host_granularity() -> int:
    """The OS page size: the smallest unit mmap and fallocate work in."""
    return os.sysconf("SC_PAGE_SIZE")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class HostPool:
    """Physical memory behind one range: a memfd whose allocated blocks are the footprint.

    ``HostPool(fd, ...)`` takes ownership of ``fd`` once it returns (if it raises, the fd stays
    the caller's); use :meth:`create` for a new pool and :meth:`attach` / :meth:`open` for one
    made by another process.
    """

    def __init__(self, fd: int, *, page_size: int, libc: LibC | None = None) -> None:
        try:
            info = os.fstat(fd)
        except OSError as exc:
            raise ReservationError(
                f"fd {fd} is not an open pool descriptor ({describe_errno(exc.errno or 0)}); "
                "pass the fd of a pool made by HostPool.create",
                errno=exc.errno,
            ) from exc
        if not stat.S_ISREG(info.st_mode) or info.st_size <= 0:
            raise ReservationError(
                f"fd {fd} is not a sized memory file; pass the fd of a pool made by HostPool.create"
            )
        if info.st_size % page_size != 0:
            raise PageSizeError(
                f"pool size {info.st_size} bytes is not a multiple of page_size {page_size}; "
                "attach with the page size the pool was created with"
            )
        self._libc = libc if libc is not None else LibC()
        self._fd = fd
        self._size_bytes = info.st_size
        self._page_size = page_size
        self._closer = weakref.finalize(self, os.close, fd)

    @classmethod
    def create(
        cls,
        size_bytes: int,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        libc: LibC | None = None,
        name: str = "elastickv-pool",
    ) -> HostPool:
        """A new, empty pool of ``size_bytes`` (a multiple of ``page_size``).

        The size is sealed (no shrink, no grow) so a peer can never cut pages out from under
        another process's mapping, which would turn accesses into SIGBUS.
        """
        import fcntl

        if size_bytes <= 0 or size_bytes % page_size != 0:
            raise ValueError(
                f"pool size {size_bytes} must be a positive multiple of page_size {page_size}"
            )
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise ReservationError(
                f"memfd_create failed: {describe_errno(exc.errno or 0)}; "
                "check the open-file limit (ulimit -n)",
                errno=exc.errno,
            ) from exc
        try:
            os.ftruncate(fd, size_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            return cls(fd, page_size=page_size, libc=libc)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise ReservationError(
                    f"sizing the {_mib(size_bytes)} memfd pool failed: "
                    f"{describe_errno(exc.errno or 0)}",
                    errno=exc.errno,
                ) from exc
            raise

    @classmethod
    def attach(
        cls, fd: int, *, page_size: int = DEFAULT_PAGE_SIZE, libc: LibC | None = None
    ) -> HostPool:
        """Use a pool whose fd this process holds (inherited or received over a socket).

        The fd is duplicated, so the caller keeps (and may close) its own copy.
        """
        try:
            own = os.dup(fd)
        except OSError as exc:
            raise ReservationError(
                f"cannot duplicate pool fd {fd}: {describe_errno(exc.errno or 0)}",
                errno=exc.errno,
            ) from exc
        try:
            return cls(own, page_size=page_size, libc=libc)
        except BaseException:
            os.close(own)
            raise

    @property
    def fd(self) -> int:
        """The pool's descriptor in this process (for ``pass_fds`` or ``SCM_RIGHTS``)."""
        self._check_open()
        return self._fd

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._size_bytes // self._page_size

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def allocate(self, first: int, count: int) -> None:
        """Make pages ``first .. first + count - 1`` physically present (``fallocate`` mode 0).

        Pages already present keep their contents.
        """
        offset, length = self._span(first, count)
        try:
            self._libc.fallocate(self._fd, 0, offset, length)
        except OSError as exc:
            code = exc.errno or 0
            where = f"{count} page(s) ({_mib(length)}) at page {first}"
            if code in _OUT_OF_MEMORY:
                raise OutOfPhysicalMemory(
                    f"no physical memory for {where}: fallocate failed with "
                    f"{describe_errno(code)}; free blocks or lower the limit (and check the "
                    "cgroup's memory.max)",
                    errno=code,
                ) from exc
            raise CommitError(
                f"fallocate of {where} failed: {describe_errno(code)}", errno=code
            ) from exc

    def punch(self, first: int, count: int) -> None:
        """Return pages ``first .. first + count - 1`` to the system (they read as zeros later)."""
        offset, length = self._span(first, count)
        try:
            self._libc.fallocate(
                self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length
            )
        except OSError as exc:
            code = exc.errno or 0
            raise ReleaseError(
                f"punching a hole for {count} page(s) at page {first} failed: "
                f"{describe_errno(code)}; the memory is still held, retry the release",
                errno=code,
            ) from exc

    def footprint_bytes(self) -> int:
        """Physical bytes the kernel holds for this pool (0 once closed)."""
        if self.closed:
            return 0
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        """Close this process's descriptor; the memory goes when the last holder lets go."""
        self._closer()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _span(self, first: int, count: int) -> tuple[int, int]:
        self._check_open()
        if count <= 0 or first < 0 or first + count > self.num_pages:
            raise PageIndexError(
                f"pages {first}..{first + count - 1} are outside this pool's pages "
                f"0..{self.num_pages - 1}"
            )
        return first * self._page_size, count * self._page_size

    def _check_open(self) -> None:
        if self.closed:
            raise RangeClosedError("this host pool was closed; create or attach a new one")


def largest_reservation(size_bytes: int, libc: LibC | None = None) -> int:
    """``size_bytes`` if this process can reserve that much address space now (the way a
    range does: anonymous ``PROT_NONE``, which costs nothing), else about the largest it can
    (within 1/64). Lets a configured capacity be checked before anything is built on it."""

    def fits(size: int) -> bool:
        try:
            address = lib.mmap(0, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        except OSError:
            return False
        lib.munmap_quietly(address, size)
        return True

    lib = libc if libc is not None else LibC()
    if size_bytes <= 0 or fits(size_bytes):
        return size_bytes
    low, high = 0, size_bytes  # fits(low) (trivially for 0), not fits(high)
    while high - low > max(high >> 6, host_granularity()):
        middle = round_up((low + high) // 2, host_granularity())
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


class _Reservation:
    """An address range that is unmapped when its last holder (range or tensor) lets go."""

    def __init__(self, libc: LibC, address: int, length: int) -> None:
        self.address = address
        self.length = length
        weakref.finalize(self, libc.munmap_quietly, address, length)


def _reserve_aligned(libc: LibC, size: int, alignment: int, granularity: int, prot: int) -> int:
    """Reserve ``size`` bytes at an ``alignment``-aligned address (trims the slack)."""
    span = size + alignment - granularity
    try:
        raw = libc.mmap(0, span, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    except OSError as exc:
        raise ReservationError(
            f"reserving {_mib(size)} of address space failed: {describe_errno(exc.errno or 0)}; "
            "check `ulimit -v` and vm.max_map_count, or reserve less",
            errno=exc.errno,
        ) from exc
    base = round_up(raw, alignment)
    head = base - raw
    tail = span - head - size
    try:
        if head:
            libc.munmap(raw, head)
        if tail:
            libc.munmap(base + size, tail)
    except OSError as exc:
        libc.munmap_quietly(raw, span)
        raise ReservationError(
            f"trimming the reservation to alignment failed: {describe_errno(exc.errno or 0)}",
            errno=exc.errno,
        ) from exc
    return base


class HostRange(VirtualRange):
    """A reserved range whose page ``i`` maps page ``i`` of a :class:`HostPool` when committed."""

    backend_name = "host"

    def __init__(
        self, pool: HostPool, *, strict: bool = True, populate: bool = False, libc: LibC
    ) -> None:
        self._idle_prot = PROT_NONE if strict else PROT_READ
        address = _reserve_aligned(
            libc, pool.size_bytes, pool.page_size, host_granularity(), self._idle_prot
        )
        self._reservation: _Reservation | None = _Reservation(libc, address, pool.size_bytes)
        super().__init__(
            base_address=address,
            size_bytes=pool.size_bytes,
            page_size=pool.page_size,
            strict=strict,
        )
        self._libc = libc
        self._pool = pool
        self._commit_flags = MAP_SHARED | MAP_FIXED | (MAP_POPULATE if populate else 0)
        self._buffer: ctypes.Array[ctypes.c_uint8] | None = None

    @property
    def pool(self) -> HostPool:
        """The physical pool; share ``pool.fd`` with a peer process to let it attach."""
        return self._pool

    def footprint_bytes(self) -> int:
        return 0 if self.closed else self._pool.footprint_bytes()

    def as_tensor(self) -> torch.Tensor:
        """Flat ``uint8`` CPU tensor over the whole range, zero copy.

        The tensor keeps the address range reserved even after :meth:`close`, so a stale
        tensor faults (or, non-strict, reads zeros) instead of touching someone else's memory.
        """
        import torch

        with self._lock:
            self._check_open()
            if self._buffer is None:
                assert self._reservation is not None
                buffer = (ctypes.c_uint8 * self.size_bytes).from_address(self.base_address)
                buffer.__dict__["reservation"] = self._reservation
                self._buffer = buffer
            return torch.frombuffer(self._buffer, dtype=torch.uint8)

    def unmap(self, pages: Iterable[int]) -> int:
        """Stop mapping ``pages`` in this process but keep their memory in the pool (for peers).

        Returns how many pages were unmapped; unmapped pages count as uncommitted here.
        """
        wanted = self._normalize(pages)
        with self._lock:
            self._check_open()
            todo = [p for p in wanted if p in self._committed]
            for first, count in page_runs(todo):
                self._map_idle(first, count)
                self._committed.difference_update(range(first, first + count))
            return len(todo)

    def _commit_run(self, first: int, count: int) -> None:
        self._pool.allocate(first, count)
        offset = first * self.page_size
        length = count * self.page_size
        try:
            self._libc.mmap(
                self.base_address + offset,
                length,
                PROT_READ | PROT_WRITE,
                self._commit_flags,
                self._pool.fd,
                offset,
            )
        except OSError as exc:
            code = exc.errno or 0
            error = CommitError(
                f"mapping {count} page(s) at page {first} failed: {describe_errno(code)}; "
                "too many separate mappings? raise vm.max_map_count or use larger pages",
                errno=code,
            )
            try:
                self._map_idle(first, count)
                self._pool.punch(first, count)
            except (ReleaseError, OSError) as cleanup:
                error.add_note(f"cleanup after the failed mapping also failed: {cleanup}")
            raise error from exc

    def _release_run(self, first: int, count: int) -> None:
        self._map_idle(first, count)
        self._pool.punch(first, count)

    def _map_idle(self, first: int, count: int) -> None:
        offset = first * self.page_size
        try:
            self._libc.mmap(
                self.base_address + offset,
                count * self.page_size,
                self._idle_prot,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                -1,
                0,
            )
        except OSError as exc:
            code = exc.errno or 0
            raise ReleaseError(
                f"unmapping {count} page(s) at page {first} failed: {describe_errno(code)}; "
                "the pages stay committed, retry the release",
                errno=code,
            ) from exc

    def _teardown(self) -> None:
        self._pool.close()
        self._buffer = None
        self._reservation = None


class HostBackend(VmmBackend):
    """Host-memory VMM backend (Linux). ``strict=True`` by default: see the module docstring.

    ``populate=True`` pre-faults committed pages (``MAP_POPULATE``): commit gets slower, the
    first write to a page faster.
    """

    name = "host"
    device_type = "cpu"

    def __init__(
        self, page_size: int = DEFAULT_PAGE_SIZE, *, strict: bool = True, populate: bool = False
    ) -> None:
        if not hasattr(os, "memfd_create"):
            raise BackendUnavailable("the host VMM backend needs os.memfd_create (Linux >= 3.17)")
        self._libc = LibC()
        super().__init__(page_size=page_size, granularity=host_granularity(), strict=strict)
        self._populate = populate

    @staticmethod
    def is_available() -> bool:
        try:
            HostBackend()
        except BackendUnavailable:
            return False
        return True

    @property
    def populate(self) -> bool:
        return self._populate

    def reserve(self, size_bytes: int) -> HostRange:
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0:
            raise ValueError(f"size_bytes must be a positive int, got {size_bytes!r}")
        size = round_up(size_bytes, self.page_size)
        pool = HostPool.create(size, page_size=self.page_size, libc=self._libc)
        return self._range_over(pool)

    def attach(self, fd: int) -> HostRange:
        """A new range (in this process) over the existing pool behind ``fd``; fd is duplicated."""
        return self._range_over(HostPool.attach(fd, page_size=self.page_size, libc=self._libc))

    def _range_over(self, pool: HostPool) -> HostRange:
        try:
            return HostRange(pool, strict=self.strict, populate=self._populate, libc=self._libc)
        except BaseException:
            pool.close()
            raise
