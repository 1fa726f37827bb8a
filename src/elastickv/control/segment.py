"""One ledger file: opening it safely, validating it, mapping it, and locking it.

Locks are Linux open-file-description byte-range locks (``F_OFD_SETLKW``): the kernel drops
them when the holder's descriptor goes away, including when the process is killed, so no lock
can outlive its holder. Unlike classic POSIX ``lockf`` locks they belong to the open file, not
to the process, so two ledgers opened in one process exclude each other and closing one does
not silently drop the other's lock. (A ``Segment`` is not thread-safe: its owner serializes
threads.) Byte 0 of the file is the mutation lock; nothing else is locked.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import stat
import struct
import time
from collections.abc import Callable

from elastickv.control.errors import (
    LedgerCorrupt,
    LedgerError,
    LedgerPermissionError,
    LedgerVersionMismatch,
)
from elastickv.control.records import (
    DYNAMIC,
    DYNAMIC_OFFSET,
    FORMAT_VERSION,
    GENERATION,
    HEADER_SIZE,
    MAGIC,
    MASK_OFFSET,
    STATIC_SIZE,
    SWEEP_OFFSET,
    FormatError,
    Header,
    decode_header,
    encode_header,
    read_prefix,
)

# struct flock on 64-bit Linux (native alignment): type, whence, start, len, pid (0 for OFD).
_FLOCK = struct.Struct("hhqqi4x")
_LOCK_WRITE = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
_LOCK_READ = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 1, 0)
_UNLOCK = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
_U64 = struct.Struct("<Q")


def new_header(
    device_key: str, total_bytes: int, utilization: float, headroom_bytes: int, capacity: int
) -> Header:
    return Header(
        device_key=device_key,
        total_bytes=total_bytes,
        utilization=utilization,
        headroom_bytes=headroom_bytes,
        capacity=capacity,
        created_ns=time.time_ns(),
        segment_id=secrets.randbits(63) | 1,
    )


def _open_fd(path: str, *, create: bool) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError as exc:
        raise LedgerError(
            f"no ledger at {path}: no instance has registered on this device"
        ) from exc
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EACCES, errno.EPERM):
            raise LedgerPermissionError(
                f"cannot open ledger {path}: {exc.strerror}; it must be a regular file you own"
            ) from exc
        raise LedgerError(f"cannot open ledger {path}: {exc.strerror}") from exc


def _check_owner(path: str, fd: int) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise LedgerPermissionError(f"ledger {path} is not a regular file; remove it")
    if info.st_uid != os.geteuid():
        raise LedgerPermissionError(
            f"ledger {path} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): "
            "refusing to share accounting with another user; use your own ledger directory "
            "(ELASTICKV_LEDGER_DIR) or run as that user"
        )
    if info.st_mode & 0o077:
        raise LedgerPermissionError(
            f"ledger {path} is accessible to other users (mode {stat.S_IMODE(info.st_mode):o}); "
            f"run `chmod 600 {path}`"
        )
    return info


def _validate(path: str, data: bytes, size: int, device_key: str | None) -> Header:
    if size < STATIC_SIZE:
        if size >= len(MAGIC) and data[: len(MAGIC)] != MAGIC:
            raise LedgerCorrupt(path, "bad magic: this file is not an elastickv ledger")
        raise LedgerCorrupt(path, f"truncated: {size} bytes, shorter than a ledger header")
    magic, version = read_prefix(data)
    if magic != MAGIC:
        raise LedgerCorrupt(path, "bad magic: this file is not an elastickv ledger")
    if version != FORMAT_VERSION:
        raise LedgerVersionMismatch(path, version, FORMAT_VERSION)
    try:
        header = decode_header(data)
    except FormatError as exc:
        raise LedgerCorrupt(path, str(exc)) from exc
    if size != header.file_size:
        raise LedgerCorrupt(
            path, f"truncated or resized: {size} bytes, its header describes {header.file_size}"
        )
    if device_key is not None and header.device_key != device_key:
        raise LedgerCorrupt(path, f"it describes device {header.device_key!r}, not {device_key!r}")
    return header


class Segment:
    """An open, validated, mapped ledger file."""

    def __init__(self, path: str, fd: int, header: Header) -> None:
        self.path = path
        self._fd = fd
        self.header = header
        self._static = encode_header(header)
        self.mm = mmap.mmap(fd, header.file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def open(cls, path: str, device_key: str, create: Callable[[], Header] | None) -> Segment:
        """Open a ledger; if ``create`` is given and the file is new or empty, initialize it
        with the header ``create()`` returns (called only then).

        Creation is race-free without ``O_EXCL``: whoever first takes the lock on an empty
        file initializes it, everyone else validates what they find.
        """
        fd = _open_fd(path, create=create is not None)
        try:
            _check_owner(path, fd)
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _LOCK_WRITE)
            try:
                size = os.fstat(fd).st_size
                if size == 0 and create is not None:
                    header = create()
                    _initialize(fd, header)
                else:
                    header = _validate(path, os.pread(fd, STATIC_SIZE, 0), size, device_key)
                return cls(path, fd, header)
            finally:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _UNLOCK)
        except BaseException:
            os.close(fd)
            raise

    # -- locking -------------------------------------------------------------------------------

    def lock(self, *, shared: bool = False) -> None:
        """Take the mutation lock (blocking), then check the file is still the one we mapped."""
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _LOCK_READ if shared else _LOCK_WRITE)
        try:
            self._revalidate()
        except BaseException:
            self.unlock()
            raise

    def unlock(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _UNLOCK)

    def _revalidate(self) -> None:
        """Cheap while nothing changed: one fstat and a 160-byte compare. A truncated file would
        turn the next access of the mapping into SIGBUS, so the size is checked first."""
        size = os.fstat(self._fd).st_size
        if size != self.header.file_size:
            raise LedgerCorrupt(
                self.path, f"resized under us: {size} bytes instead of {self.header.file_size}"
            )
        static = self.mm[:STATIC_SIZE]
        if static != self._static:
            header = _validate(self.path, static, size, self.header.device_key)
            self.header = header
            self._static = static

    # -- header fields (call with the lock held) -----------------------------------------------

    def write_header(self, header: Header) -> None:
        static = encode_header(header)
        self.mm[:STATIC_SIZE] = static
        self.header = header
        self._static = static

    def bump_generation(self) -> int:
        (generation,) = GENERATION.unpack_from(self.mm, DYNAMIC_OFFSET)
        generation += 1
        GENERATION.pack_into(self.mm, DYNAMIC_OFFSET, generation)
        return int(generation)

    @property
    def generation(self) -> int:
        return int(GENERATION.unpack_from(self.mm, DYNAMIC_OFFSET)[0])

    @property
    def mask(self) -> int:
        return int(_U64.unpack_from(self.mm, MASK_OFFSET)[0])

    @mask.setter
    def mask(self, value: int) -> None:
        _U64.pack_into(self.mm, MASK_OFFSET, value)

    @property
    def last_sweep_ns(self) -> int:
        return int(_U64.unpack_from(self.mm, SWEEP_OFFSET)[0])

    @last_sweep_ns.setter
    def last_sweep_ns(self, value: int) -> None:
        _U64.pack_into(self.mm, SWEEP_OFFSET, value)

    def dynamic(self) -> tuple[int, int, int, int]:
        """(generation, in-use mask, last sweep ns, records reclaimed)."""
        gen, mask, sweep, reclaimed = DYNAMIC.unpack_from(self.mm, DYNAMIC_OFFSET)
        return int(gen), int(mask), int(sweep), int(reclaimed)

    def add_reclaimed(self, count: int) -> None:
        _U64.pack_into(self.mm, DYNAMIC_OFFSET + 24, self.dynamic()[3] + count)

    def close(self) -> None:
        if self._fd >= 0:
            self.mm.close()
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0


def _initialize(fd: int, header: Header) -> None:
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, header.file_size)
    os.pwrite(fd, bytes(header.file_size), 0)
    os.pwrite(fd, encode_header(header), 0)


def reset_segment(path: str) -> Header | None:
    """Reinitialize a ledger in place under its lock, dropping every record.

    If the old header is still readable its budget is kept (and returned); otherwise the file
    is emptied and the next opener initializes it with its own budget. In place, not unlink +
    create, so processes still mapping it see the reset (``InstanceClosed`` or
    ``LedgerCorrupt`` on their next operation, never SIGBUS: they check the size under the
    lock) instead of carrying on in an orphaned copy.
    """
    fd = _open_fd(path, create=False)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LedgerPermissionError(f"ledger {path} is not a regular file; remove it")
        if info.st_uid != os.geteuid():
            raise LedgerPermissionError(
                f"ledger {path} belongs to uid {info.st_uid}, not to you: refusing to reset it"
            )
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _LOCK_WRITE)
        try:
            try:
                old = decode_header(os.pread(fd, STATIC_SIZE, 0))
            except FormatError:
                os.ftruncate(fd, 0)
                return None
            header = new_header(
                old.device_key, old.total_bytes, old.utilization, old.headroom_bytes, old.capacity
            )
            _initialize(fd, header)
            return header
        finally:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _UNLOCK)
    finally:
        os.close(fd)


__all__ = ["HEADER_SIZE", "Segment", "new_header", "reset_segment"]
