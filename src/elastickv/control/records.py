"""The ledger's on-disk format: one fixed header and fixed-size instance records.

Everything is little-endian and ``struct``-packed at fixed offsets so any process (and any
tool) reads it the same way. Magic and version sit at the very start, in the same place in
every format version, so a reader can tell "not a ledger" from "another version" before it
interprets anything else.

The header has a *static* part (what the device budget is; CRC-protected, rewritten only by
creation, ``configure`` and reset) and a *dynamic* part (generation, in-use mask, sweep time),
which changes on every mutation and is rebuilt from the records by a liveness sweep, so it needs
no checksum. Every record carries its own CRC: a torn or scribbled record is detected, never
trusted.
"""

from __future__ import annotations

import mmap
import re
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"EKVLEDGR"
FORMAT_VERSION = 2
HEADER_SIZE = 256
RECORD_SIZE = 192
MAX_CAPACITY = 64  # the in-use mask is one u64
NAME_BYTES = 64
DEVICE_KEY_BYTES = 64
NO_LIMIT = -1
FLAG_IN_USE = 1
# Sleep of the instance's model weights (``elastickv serve``'s asleep tier): wanted is written
# by whoever steers the instance, asleep and refused by its owner. Readers ignore bits they do
# not know, so these need no format version.
FLAG_SLEEP_WANTED = 2
FLAG_ASLEEP = 4
FLAG_SLEEP_REFUSED = 8
SLEEP_FLAGS = FLAG_SLEEP_WANTED | FLAG_ASLEEP | FLAG_SLEEP_REFUSED

# magic, version, header size, record size, capacity, reserved, device key, total bytes,
# utilization, headroom bytes, created (ns since the epoch), segment id (random per reset)
_STATIC = struct.Struct("<8sIIIII64sQdQQQ")
_STATIC_CRC = struct.Struct("<I")
STATIC_SIZE = _STATIC.size + _STATIC_CRC.size
_PREFIX = struct.Struct("<8sI")
# generation, in-use mask, last sweep (CLOCK_MONOTONIC ns), records reclaimed so far
DYNAMIC = struct.Struct("<QQQQ")
DYNAMIC_OFFSET = 192
GENERATION = struct.Struct("<Q")
MASK_OFFSET = DYNAMIC_OFFSET + 8
SWEEP_OFFSET = DYNAMIC_OFFSET + 16

# nonce, flags, pid, start time, registered (ns), limit desired (-1: none), limit revision,
# committed, reserved, peak, admissions, refusals, releases, name length, name, floor (the
# bytes the owner holds for its whole life: a limit below it could never be met)
_RECORD = struct.Struct("<QIIQQqQQQQQQQH64sQ")
_RECORD_CRC = struct.Struct("<I")
RECORD_PAYLOAD = _RECORD.size
# committed and reserved are adjacent: the admission path reads just these 16 bytes per peer.
USAGE = struct.Struct("<QQ")
NONCE = struct.Struct("<Q")
USAGE_OFFSET = 8 + 4 + 4 + 8 + 8 + 8 + 8
# The limit's revision, read without the lock by an owner that refuses from its own view of
# the limit (a torn read can only differ from the revision it saw: it then asks the ledger).
REVISION = struct.Struct("<Q")
REVISION_OFFSET = 8 + 4 + 4 + 8 + 8 + 8

assert _STATIC.size + _STATIC_CRC.size <= DYNAMIC_OFFSET
assert DYNAMIC_OFFSET + DYNAMIC.size <= HEADER_SIZE
assert _RECORD.size + _RECORD_CRC.size <= RECORD_SIZE

_NAME = re.compile(r"^[\w.:@+\-/]+$")
_DEVICE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


class FormatError(ValueError):
    """Bytes that do not decode to a valid header or record (the caller names the file)."""


def validate_name(name: str) -> str:
    """Names are typed on command lines: word characters and ``.:@+-/`` (a served model name
    such as ``org/model``, a P/D engine ``chat/prefill``), at most 64 bytes."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"invalid instance name {name!r}: use letters, digits and . _ : @ + - / (no spaces)"
        )
    if len(name.encode()) > NAME_BYTES:
        raise ValueError(f"instance name {name!r} is longer than {NAME_BYTES} bytes (utf-8)")
    return name


def validate_device_key(key: str) -> str:
    if not isinstance(key, str) or not _DEVICE_KEY.match(key) or len(key) > DEVICE_KEY_BYTES:
        raise ValueError(
            f"invalid device key {key!r}: use 'host' or 'cuda-<GPU UUID>' "
            f"(letters, digits, . _ -, at most {DEVICE_KEY_BYTES} characters)"
        )
    return key


@dataclass(frozen=True, slots=True)
class Header:
    """The static header: which device this segment describes and its budget."""

    device_key: str
    total_bytes: int
    utilization: float
    headroom_bytes: int
    capacity: int
    created_ns: int
    segment_id: int
    version: int = FORMAT_VERSION

    @property
    def budget_bytes(self) -> int:
        """What all instances together may commit: total x utilization - headroom."""
        return max(0, int(self.total_bytes * self.utilization) - self.headroom_bytes)

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.capacity * RECORD_SIZE


def validate_budget(total_bytes: int, utilization: float, headroom_bytes: int) -> None:
    if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes <= 0:
        raise ValueError(f"total_bytes must be a positive int, got {total_bytes!r}")
    if not (isinstance(utilization, int | float) and 0.0 < utilization <= 1.0):
        raise ValueError(f"utilization must be a fraction in (0, 1], got {utilization!r}")
    if (
        isinstance(headroom_bytes, bool)
        or not isinstance(headroom_bytes, int)
        or headroom_bytes < 0
    ):
        raise ValueError(f"headroom_bytes must be a non-negative int, got {headroom_bytes!r}")


def encode_header(header: Header) -> bytes:
    """The static part, CRC included (``STATIC_SIZE`` bytes)."""
    validate_device_key(header.device_key)
    validate_budget(header.total_bytes, header.utilization, header.headroom_bytes)
    if not 1 <= header.capacity <= MAX_CAPACITY:
        raise ValueError(f"capacity must be in 1..{MAX_CAPACITY}, got {header.capacity}")
    body = _STATIC.pack(
        MAGIC,
        header.version,
        HEADER_SIZE,
        RECORD_SIZE,
        header.capacity,
        0,
        header.device_key.encode(),
        header.total_bytes,
        float(header.utilization),
        header.headroom_bytes,
        header.created_ns,
        header.segment_id,
    )
    return body + _STATIC_CRC.pack(zlib.crc32(body))


def read_prefix(data: bytes) -> tuple[bytes, int]:
    """Magic and version, readable in every format version."""
    if len(data) < _PREFIX.size:
        raise FormatError(f"{len(data)} bytes is too short for a ledger header")
    magic, version = _PREFIX.unpack_from(data)
    return bytes(magic), int(version)


def decode_header(data: bytes) -> Header:
    """Parse and verify the static part; raises ``FormatError`` naming the problem."""
    if len(data) < STATIC_SIZE:
        raise FormatError(f"{len(data)} bytes is too short for a ledger header")
    body = bytes(data[: _STATIC.size])
    (stored_crc,) = _STATIC_CRC.unpack_from(data, _STATIC.size)
    (
        magic,
        version,
        header_size,
        record_size,
        capacity,
        _,
        key,
        total,
        util,
        headroom,
        created,
        segment_id,
    ) = _STATIC.unpack(body)
    if magic != MAGIC:
        raise FormatError("bad magic: this file is not an elastickv ledger")
    if zlib.crc32(body) != stored_crc:
        raise FormatError("header checksum mismatch (the header was overwritten or damaged)")
    if header_size != HEADER_SIZE or record_size != RECORD_SIZE:
        raise FormatError(f"header/record sizes {header_size}/{record_size} are not this format's")
    if not 1 <= capacity <= MAX_CAPACITY:
        raise FormatError(f"record capacity {capacity} is out of range")
    try:
        device_key = validate_device_key(key.rstrip(b"\0").decode())
        validate_budget(total, util, headroom)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"invalid header field: {exc}") from exc
    return Header(
        device_key=device_key,
        total_bytes=total,
        utilization=util,
        headroom_bytes=headroom,
        capacity=capacity,
        created_ns=created,
        segment_id=segment_id,
        version=version,
    )


@dataclass(frozen=True, slots=True)
class Record:
    """One registered instance, exactly as stored."""

    nonce: int
    flags: int
    pid: int
    start_time: int
    registered_ns: int
    limit_desired: int | None
    limit_revision: int
    committed: int
    reserved: int
    peak: int
    admissions: int
    refusals: int
    releases: int
    name: str
    floor: int = 0

    @property
    def in_use(self) -> bool:
        return bool(self.flags & FLAG_IN_USE)

    @property
    def used(self) -> int:
        return self.committed + self.reserved


FREE_RECORD = bytes(RECORD_SIZE)


def encode_record(record: Record) -> bytes:
    """``RECORD_SIZE`` bytes, CRC included."""
    name = validate_name(record.name).encode() if record.name else b""
    limit = NO_LIMIT if record.limit_desired is None else record.limit_desired
    if limit < NO_LIMIT:
        raise ValueError(f"limit must be None or >= 0, got {record.limit_desired}")
    body = _RECORD.pack(
        record.nonce,
        record.flags,
        record.pid,
        record.start_time,
        record.registered_ns,
        limit,
        record.limit_revision,
        record.committed,
        record.reserved,
        record.peak,
        record.admissions,
        record.refusals,
        record.releases,
        len(name),
        name,
        record.floor,
    )
    return body + _RECORD_CRC.pack(zlib.crc32(body)) + bytes(RECORD_SIZE - RECORD_PAYLOAD - 4)


def record_is_free(data: bytes | memoryview) -> bool:
    return bytes(data[:RECORD_SIZE]) == FREE_RECORD


def decode_record(data: bytes | memoryview) -> Record:
    """Parse and verify one record; raises ``FormatError`` if it is torn or damaged."""
    if len(data) < RECORD_SIZE:
        raise FormatError(f"{len(data)} bytes is too short for a record")
    body = bytes(data[:RECORD_PAYLOAD])
    (stored_crc,) = _RECORD_CRC.unpack_from(data, RECORD_PAYLOAD)
    if zlib.crc32(body) != stored_crc:
        raise FormatError("record checksum mismatch (torn write or damage)")
    (
        nonce,
        flags,
        pid,
        start,
        registered,
        limit,
        revision,
        committed,
        reserved,
        peak,
        admissions,
        refusals,
        releases,
        name_len,
        name,
        floor,
    ) = _RECORD.unpack(body)
    if name_len > NAME_BYTES or limit < NO_LIMIT:
        raise FormatError("record fields out of range")
    try:
        text = name[:name_len].decode()
    except UnicodeDecodeError as exc:
        raise FormatError(f"record name is not utf-8: {exc}") from exc
    return Record(
        nonce=nonce,
        flags=flags,
        pid=pid,
        start_time=start,
        registered_ns=registered,
        limit_desired=None if limit == NO_LIMIT else limit,
        limit_revision=revision,
        committed=committed,
        reserved=reserved,
        peak=peak,
        admissions=admissions,
        refusals=refusals,
        releases=releases,
        name=text,
        floor=floor,
    )


# Field positions in the raw tuple, for the admission hot path (no dataclass round trip).
F_NONCE, F_FLAGS, F_LIMIT, F_REVISION, F_COMMITTED, F_RESERVED, F_PEAK = 0, 1, 5, 6, 7, 8, 9
F_ADMISSIONS, F_REFUSALS, F_RELEASES, F_FLOOR = 10, 11, 12, 15
RawRecord = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int, bytes, int]


def read_raw(buffer: bytes | bytearray | memoryview | mmap.mmap, offset: int) -> RawRecord:
    """The record at ``offset`` as its raw field tuple, CRC-checked (``FormatError``)."""
    body = buffer[offset : offset + RECORD_PAYLOAD + 4]
    if zlib.crc32(body[:RECORD_PAYLOAD]) != _RECORD_CRC.unpack_from(body, RECORD_PAYLOAD)[0]:
        raise FormatError("record checksum mismatch (torn write or damage)")
    raw: RawRecord = _RECORD.unpack_from(body)
    return raw


def write_raw(buffer: bytearray | mmap.mmap, offset: int, raw: RawRecord | list[object]) -> None:
    """Store a raw field tuple with its CRC in one copy."""
    body = _RECORD.pack(*raw)
    buffer[offset : offset + RECORD_PAYLOAD + 4] = body + _RECORD_CRC.pack(zlib.crc32(body))


def record_offset(slot: int) -> int:
    return HEADER_SIZE + slot * RECORD_SIZE
