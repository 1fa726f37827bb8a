"""The per-device ledger: registration, admission, liveness and live limits.

Every state change happens under the segment's mutation lock (plus a thread lock, since the
kernel lock does not separate threads sharing one open file), so the check "does this fit in
the instance limit and in the device budget?" and the update are one atomic step for all
processes: committed bytes can never add up past the budget, whatever the interleaving.
Growth is admitted *before* memory is committed; nothing ever reads free memory as a snapshot.

Liveness: a record whose (pid, start time) no longer names a running process is reclaimed by
a sweep. Every operation except admission sweeps first; admission, the hot path, sweeps when it
would otherwise refuse (the only time a dead record's bytes matter) and at least every
``SWEEP_INTERVAL_NS``. A dead process's bytes are therefore available to the very next request
that needs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Generator, Iterator
from types import TracebackType
from typing import Any, Self

from elastickv.control.errors import (
    DuplicateInstance,
    InstanceClosed,
    LedgerConfigMismatch,
    LedgerCorrupt,
    LedgerError,
    LedgerFull,
    LedgerVersionMismatch,
    LimitBelowFloor,
    StaleRevision,
    UnknownInstance,
)
from elastickv.control.info import DeviceUsage, InstanceInfo, LedgerSnapshot
from elastickv.control.limits import parse_limit
from elastickv.control.liveness import ProcessIdentity, current_identity, is_alive
from elastickv.control.paths import HOST_DEVICE, ensure_directory, ledger_directory, ledger_path
from elastickv.control.records import (
    F_ADMISSIONS,
    F_COMMITTED,
    F_FLAGS,
    F_FLOOR,
    F_LIMIT,
    F_NONCE,
    F_PEAK,
    F_REFUSALS,
    F_RELEASES,
    F_RESERVED,
    F_REVISION,
    FLAG_ASLEEP,
    FLAG_IN_USE,
    FLAG_SLEEP_REFUSED,
    FLAG_SLEEP_WANTED,
    FREE_RECORD,
    MAX_CAPACITY,
    NO_LIMIT,
    NONCE,
    RECORD_SIZE,
    REVISION,
    REVISION_OFFSET,
    USAGE,
    USAGE_OFFSET,
    FormatError,
    Header,
    Record,
    decode_record,
    encode_record,
    read_raw,
    record_offset,
    validate_budget,
    validate_device_key,
    validate_name,
    write_raw,
)
from elastickv.control.segment import Segment, new_header, reset_segment

DEFAULT_UTILIZATION = 0.9
DEFAULT_HEADROOM = 0
DEFAULT_CAPACITY = MAX_CAPACITY
SWEEP_INTERVAL_NS = 200_000_000
# How long an instance trusts its own limit as the ledger last showed it (and its revision
# still in the record) to refuse growth beyond it without the ledger's lock (see
# :meth:`InstanceHandle.try_admit`): past it the ledger is asked, which also finds a ledger
# that was reset meanwhile.
LIMIT_VIEW_NS = 20_000_000
# How long an instance answers "am I over my limit?" from the limit it last read, while the
# record's limit revision is unchanged (see :meth:`InstanceHandle.over_limit_bytes`): a
# ledger reset or reclaim of a live instance's record is seen at most this late.
OVER_LIMIT_VIEW_NS = 1_000_000_000

LimitSpec = int | str | None


def host_total_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _default_name(pid: int) -> str:
    prog = os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "") or "python"
    prog = re.sub(r"[^\w.\-]+", "_", prog.removesuffix(".py"))[:40] or "python"
    return f"{prog}-{pid}"


def _check_bytes(nbytes: int) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"byte counts must be non-negative ints, got {nbytes!r}")


class Ledger:
    """An open ledger for one device. Thread-safe; open it again in a forked child."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self._lock = threading.Lock()
        self._me = current_identity()
        self._handles: dict[int, InstanceHandle] = {}

    @classmethod
    def open(
        cls,
        device: str = HOST_DEVICE,
        *,
        total_bytes: int | None = None,
        utilization: float | None = None,
        headroom_bytes: int | None = None,
        capacity: int | None = None,
        directory: str | None = None,
        create: bool = True,
    ) -> Ledger:
        """Open the ledger of ``device``, creating it on first use.

        The budget arguments initialize a new ledger; for an existing one they must match what
        it holds (or be omitted), so colocated instances cannot silently disagree about the
        budget: change it live with :meth:`configure` instead.
        """
        key = validate_device_key(device)
        folder = directory or ledger_directory()
        if create:
            ensure_directory(folder)
        path = ledger_path(key, folder)

        def initial_header() -> Header:
            total = total_bytes
            if total is None:
                if key != HOST_DEVICE:
                    raise ValueError(
                        f"total_bytes is required to create the ledger of device {key!r} "
                        "(pass the device's memory size)"
                    )
                total = host_total_bytes()
            util = DEFAULT_UTILIZATION if utilization is None else utilization
            headroom = DEFAULT_HEADROOM if headroom_bytes is None else headroom_bytes
            validate_budget(total, util, headroom)
            return new_header(key, total, util, headroom, capacity or DEFAULT_CAPACITY)

        segment = Segment.open(path, key, initial_header if create else None)
        found = segment.header
        mismatches = [
            f"{what} {asked!r} (the ledger has {held!r})"
            for what, asked, held in (
                ("total_bytes", total_bytes, found.total_bytes),
                ("utilization", utilization, found.utilization),
                ("headroom_bytes", headroom_bytes, found.headroom_bytes),
                ("capacity", capacity, found.capacity),
            )
            if asked is not None and asked != held
        ]
        if mismatches:
            segment.close()
            raise LedgerConfigMismatch(
                f"ledger {path} already exists with another budget: asked for "
                + ", ".join(mismatches)
                + "; omit these arguments to join it, or change it with Ledger.configure"
            )
        try:
            return cls(segment)
        except BaseException:
            segment.close()
            raise

    @staticmethod
    def reset(path: str) -> None:
        """Reinitialize a damaged or foreign ledger file (``elastickv doctor --reset-ledger``).

        Every record is dropped; processes still using it get ``InstanceClosed`` (or
        ``LedgerCorrupt``) on their next operation and must register again. The budget is kept
        if the old header is readable, else the next opener sets it. A missing file is fine.
        """
        if os.path.lexists(path):
            reset_segment(path)

    # -- description ---------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._segment.path

    @property
    def device(self) -> str:
        return self._segment.header.device_key

    @property
    def header(self) -> Header:
        return self._segment.header

    @property
    def closed(self) -> bool:
        return self._segment.closed

    # -- locking -------------------------------------------------------------------------------

    def _enter(self) -> Segment:
        """Thread lock, then the segment lock. Callers must call :meth:`_exit`."""
        self._lock.acquire()
        try:
            segment = self._segment
            if segment.closed:
                raise LedgerError(f"ledger {segment.path} is closed")
            if os.getpid() != self._me.pid:
                raise LedgerError(
                    f"ledger {segment.path} was opened in process {self._me.pid} and is used in "
                    f"forked process {os.getpid()}; open the ledger again in the child"
                )
            segment.lock()
        except BaseException:
            self._lock.release()
            raise
        return segment

    def _exit(self) -> None:
        try:
            self._segment.unlock()
        finally:
            self._lock.release()

    # -- records (lock held) -------------------------------------------------------------------

    def _read(self, segment: Segment, slot: int) -> Record | None:
        offset = record_offset(slot)
        raw = segment.mm[offset : offset + RECORD_SIZE]
        if raw == FREE_RECORD:
            return None
        try:
            return decode_record(raw)
        except FormatError as exc:
            raise LedgerCorrupt(segment.path, f"record {slot}: {exc}") from exc

    def _write(self, segment: Segment, slot: int, record: Record | None) -> None:
        offset = record_offset(slot)
        segment.mm[offset : offset + RECORD_SIZE] = (
            FREE_RECORD if record is None else encode_record(record)
        )

    def _own(self, segment: Segment, handle: InstanceHandle) -> Record:
        record = self._read(segment, handle.slot)
        if record is None or record.nonce != handle.nonce:
            handle._mark_gone()
            raise InstanceClosed(
                f"instance {handle.name!r} is no longer registered in {segment.path} (its "
                "record was reset or reclaimed); register again"
            )
        limit = NO_LIMIT if record.limit_desired is None else record.limit_desired
        handle._saw_limit(limit, record.limit_revision)
        return record

    def _alive(self, record: Record) -> bool:
        if record.pid == self._me.pid:
            return record.start_time == self._me.start_time
        return is_alive(ProcessIdentity(record.pid, record.start_time))

    def _sweep(self, segment: Segment) -> int:
        """Reclaim dead records and rebuild the in-use mask; returns how many were reclaimed."""
        reclaimed = 0
        mask = 0
        for slot in range(segment.header.capacity):
            record = self._read(segment, slot)
            if record is None:
                continue
            if record.in_use and self._alive(record):
                mask |= 1 << slot
            else:
                self._write(segment, slot, None)
                reclaimed += 1
        if segment.mask != mask:
            segment.mask = mask
        segment.last_sweep_ns = time.monotonic_ns()
        if reclaimed:
            segment.add_reclaimed(reclaimed)
            segment.bump_generation()
        return reclaimed

    def _others_used(self, segment: Segment, own_slot: int) -> int:
        mm = segment.mm
        total = 0
        mask = segment.mask & ~(1 << own_slot)
        while mask:
            low = mask & -mask
            committed, reserved = USAGE.unpack_from(
                mm, record_offset(low.bit_length() - 1) + USAGE_OFFSET
            )
            total += committed + reserved
            mask ^= low
        return int(total)

    def _live_records(self, segment: Segment) -> list[tuple[int, Record]]:
        out: list[tuple[int, Record]] = []
        mask = segment.mask
        for slot in range(segment.header.capacity):
            if mask >> slot & 1:
                record = self._read(segment, slot)
                if record is not None:
                    out.append((slot, record))
        return out

    def _fits(self, segment: Segment, slot: int, limit: int, used: int, growth: int) -> bool:
        """Would ``growth`` more bytes fit the instance's limit (raw: -1 for none) and the
        device budget? Sweeps (once) before refusing for the budget, so dead peers never block
        a live one."""
        budget = segment.header.budget_bytes
        need = used + growth
        if need > (budget if limit < 0 else min(limit, budget)):
            return False
        if time.monotonic_ns() - segment.last_sweep_ns > SWEEP_INTERVAL_NS:
            self._sweep(segment)
        if self._others_used(segment, slot) + need <= budget:
            return True
        return bool(self._sweep(segment)) and self._others_used(segment, slot) + need <= budget

    def _named(self, segment: Segment, name: str) -> tuple[int, Record]:
        """The live record named ``name`` and its slot (``UnknownInstance`` if none)."""
        found = [(s, r) for s, r in self._live_records(segment) if r.name == name]
        if not found:
            raise UnknownInstance(
                f"no live instance named {name!r} in {segment.path}; "
                "`elastickv list` (in Python: list_instances()) shows the registered names"
            )
        return found[0]

    def _own_raw(self, segment: Segment, handle: InstanceHandle) -> list[Any]:
        offset = record_offset(handle.slot)
        try:
            raw = read_raw(segment.mm, offset)
        except FormatError as exc:
            if NONCE.unpack_from(segment.mm, offset)[0] == 0:
                raw = None  # a free slot: our record was reclaimed or reset
            else:
                raise LedgerCorrupt(segment.path, f"record {handle.slot}: {exc}") from exc
        if raw is None or raw[F_NONCE] != handle.nonce:
            handle._mark_gone()
            raise InstanceClosed(
                f"instance {handle.name!r} is no longer registered in {segment.path} (its "
                "record was reset or reclaimed); register again"
            )
        fields: list[Any] = list(raw)
        handle._saw_limit(fields[F_LIMIT], fields[F_REVISION])
        return fields

    def _revision_now(self, slot: int) -> int:
        """The limit revision in ``slot``'s record, read without the lock (-1 when the
        segment is closed)."""
        try:
            revision: int = REVISION.unpack_from(
                self._segment.mm, record_offset(slot) + REVISION_OFFSET
            )[0]
        except ValueError:  # unmapped
            return -1
        return revision

    def _info(self, segment: Segment, slot: int, record: Record, *, alive: bool) -> InstanceInfo:
        budget = segment.header.budget_bytes
        cap = budget if record.limit_desired is None else min(record.limit_desired, budget)
        return InstanceInfo(
            name=record.name,
            pid=record.pid,
            alive=alive,
            slot=slot,
            limit_desired=record.limit_desired,
            limit_effective=max(cap, record.used),
            limit_revision=record.limit_revision,
            committed_bytes=record.committed,
            reserved_bytes=record.reserved,
            peak_bytes=record.peak,
            admissions=record.admissions,
            refusals=record.refusals,
            releases=record.releases,
            registered_at=record.registered_ns / 1e9,
            floor_bytes=record.floor,
            sleep_wanted=bool(record.flags & FLAG_SLEEP_WANTED),
            asleep=bool(record.flags & FLAG_ASLEEP),
            sleep_refused=bool(record.flags & FLAG_SLEEP_REFUSED),
        )

    def _usage(self, segment: Segment, records: list[tuple[int, Record]]) -> DeviceUsage:
        header = segment.header
        generation, _, _, reclaimed = segment.dynamic()
        return DeviceUsage(
            device=header.device_key,
            path=segment.path,
            total_bytes=header.total_bytes,
            utilization=header.utilization,
            headroom_bytes=header.headroom_bytes,
            budget_bytes=header.budget_bytes,
            committed_bytes=sum(r.committed for _, r in records),
            reserved_bytes=sum(r.reserved for _, r in records),
            instances=len(records),
            capacity=header.capacity,
            generation=generation,
            reclaimed=reclaimed,
        )

    def _resolve_limit(self, segment: Segment, limit: LimitSpec) -> int | None:
        if isinstance(limit, str):
            return parse_limit(limit, segment.header.budget_bytes)
        if limit is not None:
            _check_bytes(limit)
        return limit

    # -- registration --------------------------------------------------------------------------

    def register(self, name: str | None = None, *, limit: LimitSpec = None) -> InstanceHandle:
        """Register this process's instance; ``name`` defaults to ``<program>-<pid>``.

        Raises ``DuplicateInstance`` if a live instance holds the name and ``LedgerFull`` if
        every slot is taken by a live instance.
        """
        if name is not None:
            validate_name(name)
        segment = self._enter()
        try:
            self._sweep(segment)
            desired = self._resolve_limit(segment, limit)
            live = self._live_records(segment)
            taken = {record.name for _, record in live}
            if name is None:
                base = _default_name(self._me.pid)
                name = base
                suffix = 1
                while name in taken:
                    suffix += 1
                    name = f"{base}-{suffix}"
            elif name in taken:
                owner = next(r.pid for _, r in live if r.name == name)
                raise DuplicateInstance(
                    f"instance name {name!r} is already registered by live process {owner} in "
                    f"{segment.path}; choose another name"
                )
            used = {slot for slot, _ in live}
            free = next((s for s in range(segment.header.capacity) if s not in used), None)
            if free is None:
                raise LedgerFull(
                    f"ledger {segment.path} is full: {segment.header.capacity} live instances "
                    "are registered on this device; stop one, or reset the ledger with a larger "
                    "capacity when none is running"
                )
            record = Record(
                nonce=secrets.randbits(63) | 1,
                flags=FLAG_IN_USE,
                pid=self._me.pid,
                start_time=self._me.start_time,
                registered_ns=time.time_ns(),
                limit_desired=desired,
                limit_revision=1,
                committed=0,
                reserved=0,
                peak=0,
                admissions=0,
                refusals=0,
                releases=0,
                name=name,
            )
            self._write(segment, free, record)
            segment.mask = segment.mask | 1 << free
            segment.bump_generation()
            handle = InstanceHandle(self, free, record.nonce, name)
            self._handles[free] = handle
            return handle
        finally:
            self._exit()

    def _unregister(self, handle: InstanceHandle) -> None:
        segment = self._enter()
        try:
            # The nonce alone says whose slot it is, so a damaged record of ours is still
            # cleared on the way out instead of blocking the exit.
            offset = record_offset(handle.slot)
            if NONCE.unpack_from(segment.mm, offset)[0] == handle.nonce:
                segment.mask = segment.mask & ~(1 << handle.slot)
                self._write(segment, handle.slot, None)
                segment.bump_generation()
        finally:
            self._handles.pop(handle.slot, None)
            self._exit()

    # -- admission (called through InstanceHandle) ---------------------------------------------

    def _admit(self, handle: InstanceHandle, nbytes: int) -> bool:
        segment = self._enter()
        try:
            raw = self._own_raw(segment, handle)
            raw[F_REFUSALS] += handle._take_local_refusals()  # written on both paths below
            committed, reserved = raw[F_COMMITTED], raw[F_RESERVED]
            from_reserve = min(nbytes, reserved)
            growth = nbytes - from_reserve
            slot = handle.slot
            if growth and not self._fits(segment, slot, raw[F_LIMIT], committed + reserved, growth):
                raw[F_REFUSALS] += 1
                write_raw(segment.mm, record_offset(slot), raw)
                segment.bump_generation()
                return False
            committed += nbytes
            reserved -= from_reserve
            raw[F_COMMITTED] = committed
            raw[F_RESERVED] = reserved
            raw[F_PEAK] = max(raw[F_PEAK], committed + reserved)
            raw[F_ADMISSIONS] += 1
            write_raw(segment.mm, record_offset(slot), raw)
            segment.bump_generation()
            handle._committed = committed
            handle._reserved = reserved
            return True
        finally:
            self._exit()

    def _release(self, handle: InstanceHandle, nbytes: int) -> None:
        segment = self._enter()
        try:
            try:
                raw = self._own_raw(segment, handle)
            except InstanceClosed:
                return  # reset under us: the record and its bytes are already gone
            committed = raw[F_COMMITTED]
            if nbytes > committed:
                raise ValueError(
                    f"instance {handle.name!r} releases {nbytes} bytes but holds only "
                    f"{committed} committed"
                )
            committed -= nbytes
            raw[F_COMMITTED] = committed
            raw[F_RELEASES] += 1
            write_raw(segment.mm, record_offset(handle.slot), raw)
            segment.bump_generation()
            handle._committed = committed
        finally:
            self._exit()

    def _set_reserved(self, handle: InstanceHandle, nbytes: int) -> bool:
        segment = self._enter()
        try:
            raw = self._own_raw(segment, handle)
            committed, reserved = raw[F_COMMITTED], raw[F_RESERVED]
            growth = nbytes - reserved
            used = committed + reserved
            if growth > 0 and not self._fits(segment, handle.slot, raw[F_LIMIT], used, growth):
                return False
            raw[F_RESERVED] = nbytes
            raw[F_PEAK] = max(raw[F_PEAK], committed + nbytes)
            write_raw(segment.mm, record_offset(handle.slot), raw)
            segment.bump_generation()
            handle._reserved = nbytes
            return True
        finally:
            self._exit()

    def _settle(self, handle: InstanceHandle, committed: int, credit: int) -> int:
        segment = self._enter()
        try:
            raw = self._own_raw(segment, handle)
            raw[F_REFUSALS] += handle._take_local_refusals()
            held = raw[F_COMMITTED] + raw[F_RESERVED]
            if committed > held:
                raise ValueError(
                    f"instance {handle.name!r} reports {committed} bytes committed but holds "
                    f"only {held} (committed and credit) in the ledger"
                )
            slot = handle.slot
            limit = raw[F_LIMIT]
            budget = segment.header.budget_bytes
            cap = budget if limit < 0 else min(limit, budget)
            granted = min(credit, max(0, cap - committed))
            if committed + granted > held:
                # Growth: it must also fit beside every other instance (dead ones reclaimed
                # first, so that they never hold a live one back).
                if time.monotonic_ns() - segment.last_sweep_ns > SWEEP_INTERVAL_NS:
                    self._sweep(segment)
                room = budget - self._others_used(segment, slot) - committed
                if room < granted and self._sweep(segment):
                    room = budget - self._others_used(segment, slot) - committed
                granted = max(0, min(granted, room))
            if granted < credit and committed + credit > held:
                raw[F_REFUSALS] += 1  # the growth asked for was refused (in part)
            if committed > raw[F_COMMITTED]:
                raw[F_ADMISSIONS] += 1
            elif committed < raw[F_COMMITTED]:
                raw[F_RELEASES] += 1
            raw[F_COMMITTED] = committed
            raw[F_RESERVED] = granted
            raw[F_PEAK] = max(raw[F_PEAK], committed + granted)
            write_raw(segment.mm, record_offset(slot), raw)
            segment.bump_generation()
            handle._committed = committed
            handle._reserved = granted
            return granted
        finally:
            self._exit()

    def _set_floor(self, handle: InstanceHandle, nbytes: int) -> None:
        segment = self._enter()
        try:
            raw = self._own_raw(segment, handle)
            raw[F_FLOOR] = nbytes
            write_raw(segment.mm, record_offset(handle.slot), raw)
            segment.bump_generation()
        finally:
            self._exit()

    def _own_flags(self, handle: InstanceHandle, set_bits: int = 0, clear_bits: int = 0) -> int:
        """The owner's record flags, with ``set_bits`` set and ``clear_bits`` cleared first
        (written only when they change); returns the flags now."""
        segment = self._enter()
        try:
            raw = self._own_raw(segment, handle)
            flags: int = (raw[F_FLAGS] | set_bits) & ~clear_bits
            if flags != raw[F_FLAGS]:
                raw[F_FLAGS] = flags
                write_raw(segment.mm, record_offset(handle.slot), raw)
                segment.bump_generation()
            return flags
        finally:
            self._exit()

    def _available(self, handle: InstanceHandle) -> int:
        segment = self._enter()
        try:
            record = self._own(segment, handle)
            budget = segment.header.budget_bytes
            cap = budget if record.limit_desired is None else min(record.limit_desired, budget)
            device_free = budget - self._others_used(segment, handle.slot) - record.used
            return record.reserved + max(0, min(cap - record.used, device_free))
        finally:
            self._exit()

    def _handle_info(self, handle: InstanceHandle) -> InstanceInfo:
        segment = self._enter()
        try:
            pending = handle._take_local_refusals()
            if pending:  # the owner reads counts that include its own refusals
                raw = self._own_raw(segment, handle)
                raw[F_REFUSALS] += pending
                write_raw(segment.mm, record_offset(handle.slot), raw)
                segment.bump_generation()
            return self._info(segment, handle.slot, self._own(segment, handle), alive=True)
        finally:
            self._exit()

    # -- operator API --------------------------------------------------------------------------

    def sweep(self) -> int:
        """Reclaim the records of dead processes now; returns how many were reclaimed."""
        segment = self._enter()
        try:
            return self._sweep(segment)
        finally:
            self._exit()

    def snapshot(self) -> LedgerSnapshot:
        """Usage and live instances, read under one lock (after a liveness sweep)."""
        with self.frozen() as snap:
            return snap

    @contextlib.contextmanager
    def frozen(self) -> Iterator[LedgerSnapshot]:
        """Hold the ledger still: no instance on this device is admitted or releases bytes
        until the block exits. For checks that compare the ledger with another source (kernel
        footprints) without racing it; keep the block short, every instance waits on it."""
        segment = self._enter()
        try:
            self._sweep(segment)
            records = self._live_records(segment)
            yield LedgerSnapshot(
                usage=self._usage(segment, records),
                instances=tuple(
                    self._info(segment, slot, record, alive=True) for slot, record in records
                ),
                taken_at=time.time(),
            )
        finally:
            self._exit()

    def list_instances(self) -> list[InstanceInfo]:
        return list(self.snapshot().instances)

    def device_usage(self) -> DeviceUsage:
        return self.snapshot().usage

    def set_limit(
        self, name: str, limit: LimitSpec, *, expected_revision: int | None = None
    ) -> int:
        """Set instance ``name``'s limit (bytes, ``"2G"``, ``"30%"`` of the budget, or None for
        none); returns the new revision.

        A shrink takes effect at once for admission; what the instance holds above the new
        limit, committed or reserved (its credit: room it may already have counted on), stays
        until the owner gives it back (it sees ``over_limit_bytes``: credit first, then
        pages), and no growth is admitted meanwhile. Only the owner changes its own reserve.
        Raising or removing the limit re-enables growth immediately. With
        ``expected_revision``, the change applies only if nobody changed the limit since
        (else ``StaleRevision``).
        """
        segment = self._enter()
        try:
            self._sweep(segment)
            desired = self._resolve_limit(segment, limit)
            slot, record = self._named(segment, name)
            if expected_revision is not None and expected_revision != record.limit_revision:
                raise StaleRevision(name, expected_revision, record.limit_revision)
            if desired is not None and desired < record.floor:
                raise LimitBelowFloor(name, desired, record.floor)
            revision = record.limit_revision + 1
            self._write(
                segment,
                slot,
                dataclasses.replace(record, limit_desired=desired, limit_revision=revision),
            )
            segment.bump_generation()
            handle = self._handles.get(slot)
            if handle is not None and handle.nonce == record.nonce:
                handle._saw_limit(NO_LIMIT if desired is None else desired, revision)
            return revision
        finally:
            self._exit()

    def request_sleep(self, name: str, wanted: bool = True) -> None:
        """Ask instance ``name`` to put its model's weights to sleep (``wanted``), or to keep
        them awake (False: a sleeping one wakes, and a refusal is forgotten). The owner
        answers in its record (``InstanceInfo.asleep`` / ``sleep_refused``) when it next
        looks: an engine looks while it idles. ``UnknownInstance`` when no live record has
        that name."""
        segment = self._enter()
        try:
            self._sweep(segment)
            slot, record = self._named(segment, name)
            flags = record.flags | FLAG_SLEEP_WANTED
            if not wanted:
                flags &= ~(FLAG_SLEEP_WANTED | FLAG_SLEEP_REFUSED)
            if flags != record.flags:
                self._write(segment, slot, dataclasses.replace(record, flags=flags))
                segment.bump_generation()
        finally:
            self._exit()

    def configure(
        self,
        *,
        total_bytes: int | None = None,
        utilization: float | None = None,
        headroom_bytes: int | None = None,
    ) -> DeviceUsage:
        """Change the device budget live. Lowering it below current use is lazy, like a limit
        shrink: nothing is taken back, growth is refused until enough is released."""
        segment = self._enter()
        try:
            old = segment.header
            header = Header(
                device_key=old.device_key,
                total_bytes=old.total_bytes if total_bytes is None else total_bytes,
                utilization=old.utilization if utilization is None else utilization,
                headroom_bytes=old.headroom_bytes if headroom_bytes is None else headroom_bytes,
                capacity=old.capacity,
                created_ns=old.created_ns,
                segment_id=old.segment_id,
            )
            validate_budget(header.total_bytes, header.utilization, header.headroom_bytes)
            segment.write_header(header)
            segment.bump_generation()
            self._sweep(segment)
            return self._usage(segment, self._live_records(segment))
        finally:
            self._exit()

    def watch(
        self, interval: float = 1.0, *, changes_only: bool = False
    ) -> Generator[LedgerSnapshot, None, None]:
        """Snapshots every ``interval`` seconds, the first at once; with ``changes_only``, only
        when the generation moved. Runs in the caller's thread; stop by closing the iterator."""
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        last = -1
        while True:
            snap = self.snapshot()
            if not changes_only or snap.usage.generation != last:
                last = snap.usage.generation
                yield snap
            time.sleep(interval)

    def close(self) -> None:
        """Unregister this ledger's instances (a clean exit) and unmap the segment."""
        if self._segment.closed:
            return
        try:
            for handle in list(self._handles.values()):
                handle.close()
        finally:
            with self._lock:
                self._segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class InstanceHandle:
    """One registered instance: admission of its physical growth, its reserve, its record.

    Close it (or use it as a context manager) on a clean exit, after releasing its memory; a
    process that dies without closing is reclaimed by liveness instead. ``release`` on a closed
    handle is a no-op (the record, and its bytes, are already gone), so an allocator closed
    after its handle does not fail.
    """

    def __init__(self, ledger: Ledger, slot: int, nonce: int, name: str) -> None:
        self._ledger = ledger
        self.slot = slot
        self.nonce = nonce
        self.name = name
        self._committed = 0
        self._reserved = 0
        self._closed = False
        # This instance's limit (raw: -1 for none) and its revision as its last ledger
        # operation read them, when, and the refusals made from that view and not yet counted
        # in the record.
        self._limit_seen = -1
        self._revision_seen = -1
        self._limit_seen_ns = 0
        self._local_refusals = 0

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def committed_bytes(self) -> int:
        """Bytes admitted and not released (this process's view; the ledger agrees)."""
        return self._committed

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def _mark_gone(self) -> None:
        self._closed = True
        self._ledger._handles.pop(self.slot, None)

    def _check_open(self) -> None:
        if self._closed:
            raise InstanceClosed(f"instance {self.name!r} is unregistered; register again")

    def try_admit(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` in the ledger before committing them; False = "not now" (over the
        instance's limit or the device budget; nothing changed). Draws on the reserve first.

        Growth beyond the instance's own limit, as its last ledger operation read it within
        ``LIMIT_VIEW_NS`` and while the record's limit revision is still the one it read, is
        refused here without the ledger's lock: an engine at its limit asks on every
        scheduler step, and a ledger round trip took 80 µs there (two file locks and an
        ``fstat`` while the model's threads run), eight times its idle cost. A limit changed
        by any process is seen at the next call. The record's refusal count still includes
        these refusals: they are added at the next admission that reaches the ledger or the
        next :meth:`info`."""
        _check_bytes(nbytes)
        self._check_open()
        if self._over_seen_limit(nbytes):
            with self._ledger._lock:
                self._local_refusals += 1
            return False
        return self._ledger._admit(self, nbytes)

    def _over_seen_limit(self, nbytes: int) -> bool:
        limit = self._limit_seen
        if limit < 0:
            return False
        growth = nbytes - min(nbytes, self._reserved)
        return (
            growth > 0
            and self._committed + self._reserved + growth > limit
            and self._limit_view_current(LIMIT_VIEW_NS)
        )

    def _limit_view_current(self, max_age_ns: int) -> bool:
        """Whether the limit this instance's last ledger operation read is under
        ``max_age_ns`` old and its revision still the record's (one 8-byte read, no lock)."""
        seen = self._limit_seen_ns
        return (
            seen > 0
            and time.monotonic_ns() - seen < max_age_ns
            and self._ledger._revision_now(self.slot) == self._revision_seen
        )

    def _saw_limit(self, limit: int, revision: int) -> None:
        """The ledger showed this instance's limit (raw) and its revision (lock held)."""
        self._limit_seen = limit
        self._revision_seen = revision
        self._limit_seen_ns = time.monotonic_ns()

    def _take_local_refusals(self) -> int:
        """Refusals made from the seen limit since the last call (lock held)."""
        pending, self._local_refusals = self._local_refusals, 0
        return pending

    def release(self, nbytes: int) -> None:
        """Return ``nbytes`` of committed memory to the device budget."""
        _check_bytes(nbytes)
        if self._closed:
            return
        self._ledger._release(self, nbytes)

    def set_reserved_bytes(self, nbytes: int) -> bool:
        """Claim ``nbytes`` for future growth (the hot reserve): counted in use by the limit and
        the device budget, consumed first by ``try_admit``. Shrinking always succeeds; growing
        answers False when it does not fit (the reserve is then unchanged)."""
        _check_bytes(nbytes)
        self._check_open()
        return self._ledger._set_reserved(self, nbytes)

    def settle(self, committed: int, credit: int) -> int:
        """Publish this instance's committed bytes (its own exact count, which may have grown
        from its credit or shrunk since the last call) and ask for ``credit`` bytes of credit:
        room held ahead of demand, counted as reserved by the limit and the device budget.
        Returns the credit granted: ``credit``, or as much of it as the live limit and the
        device budget allow now (0 when the instance is at or over its limit). What the
        record holds in all (committed and credit) grows only when it fits; a lowered limit
        takes credit back first. ``committed`` may never exceed what the record holds."""
        _check_bytes(committed)
        _check_bytes(credit)
        self._check_open()
        return self._ledger._settle(self, committed, credit)

    def limit_allows(self, nbytes: int) -> bool:
        """Whether holding ``nbytes`` in all (committed and credit) may fit this instance's
        limit, answered without the ledger's lock from the limit its last ledger operation
        read, while that view is under ``LIMIT_VIEW_NS`` old and the limit's revision is
        unchanged (else True: only the ledger can say). An engine at its limit asks for
        credit on every step while requests wait; this answers it locally, as
        :meth:`try_admit` refuses growth (not counted as a refusal: nothing was asked)."""
        limit = self._limit_seen
        return limit < 0 or nbytes <= limit or not self._limit_view_current(LIMIT_VIEW_NS)

    def limit_room(self, held: int, max_age_ns: int | None = None) -> int | None:
        """What this instance's limit leaves beyond ``held`` bytes (committed and credit),
        from the limit its last ledger operation read, while that view is current as for
        :meth:`limit_allows` (under ``max_age_ns`` old when given, else ``LIMIT_VIEW_NS``);
        None when only the ledger can say (no limit, or an old view)."""
        limit = self._limit_seen
        age = LIMIT_VIEW_NS if max_age_ns is None else max_age_ns
        if limit < 0 or not self._limit_view_current(age):
            return None
        return max(0, limit - held)

    def set_floor_bytes(self, nbytes: int) -> None:
        """Publish what this instance holds for its whole life (e.g. a KV cache's null block):
        ``set_limit`` then refuses limits below it, which could never be met."""
        _check_bytes(nbytes)
        self._check_open()
        self._ledger._set_floor(self, nbytes)

    def sleep_wanted(self) -> bool:
        """Whether this instance was asked to put its weights to sleep
        (:meth:`Ledger.request_sleep`)."""
        self._check_open()
        return bool(self._ledger._own_flags(self) & FLAG_SLEEP_WANTED)

    def set_sleep_state(self, *, asleep: bool, refused: bool = False) -> None:
        """Answer a sleep request in the record: asleep now (or awake again), or ``refused``
        (this instance cannot release its weights; cleared when the request is withdrawn)."""
        self._check_open()
        set_bits = (FLAG_ASLEEP if asleep else 0) | (FLAG_SLEEP_REFUSED if refused else 0)
        clear_bits = (0 if asleep else FLAG_ASLEEP) | (0 if refused else FLAG_SLEEP_REFUSED)
        self._ledger._own_flags(self, set_bits, clear_bits)

    def available_bytes(self) -> int:
        """What ``try_admit`` could grant now (a snapshot)."""
        self._check_open()
        return self._ledger._available(self)

    def info(self) -> InstanceInfo:
        """This instance's record, limit and counters as the ledger holds them now."""
        self._check_open()
        return self._ledger._handle_info(self)

    def over_limit_bytes(self) -> int:
        """What ``info().over_limit_bytes`` says (how much this instance must release to get
        under its limit), from its own usage and the limit its last ledger operation read,
        while that view is under ``OVER_LIMIT_VIEW_NS`` old and the record's limit revision is
        still the one it read (one 8-byte read, no lock); else from the ledger. An engine
        asks every 50 ms whether an operator lowered its limit, and a ledger read took 80 µs
        inside a running engine (two file locks and an ``fstat``); a changed limit is still
        seen at the next call."""
        self._check_open()
        if self._limit_view_current(OVER_LIMIT_VIEW_NS):
            limit = self._limit_seen
            if limit == NO_LIMIT:
                return 0
            return max(0, self._committed + self._reserved - limit)
        return self.info().over_limit_bytes

    def close(self) -> None:
        """Unregister (idempotent). Never fails on a damaged ledger: the operation that met
        the damage already reported it, and reset drops every record anyway."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ledger._unregister(self)
        except (LedgerCorrupt, LedgerVersionMismatch):
            self._ledger._handles.pop(self.slot, None)

    unregister = close

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_ledger(
    device: str = HOST_DEVICE,
    *,
    total_bytes: int | None = None,
    utilization: float | None = None,
    headroom_bytes: int | None = None,
    capacity: int | None = None,
    directory: str | None = None,
    create: bool = True,
) -> Ledger:
    """Open (creating on first use) the ledger of ``device``: ``"host"`` or
    ``cuda_device_key(uuid)``. See :meth:`Ledger.open`."""
    return Ledger.open(
        device,
        total_bytes=total_bytes,
        utilization=utilization,
        headroom_bytes=headroom_bytes,
        capacity=capacity,
        directory=directory,
        create=create,
    )


__all__ = ["InstanceHandle", "Ledger", "ledger_path", "open_ledger"]
