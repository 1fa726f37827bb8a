"""CUDA device-memory backend over the driver's virtual memory management (VMM) API.

Why this shape:

* The range is a ``cuMemAddressReserve`` reservation: address space only, no memory.
* Each committed page is one physical allocation (``cuMemCreate`` of ``page_size`` bytes)
  mapped with ``cuMemMap``; access is granted with one ``cuMemSetAccess`` per contiguous run,
  because set-access dominates the map path (tens of µs per call vs ~1.5 µs for a map).
* ``cuMemCreate`` costs several times a map, so released handles go to a bounded per-range
  :class:`HandlePool` and the next commit reuses them; handles beyond the bound are released
  at once with ``cuMemRelease``. Pooled handles hold device memory that no page uses:
  :meth:`CudaRange.held_bytes` counts them, :meth:`CudaRange.trim_pool` returns them.
* Release unmaps page by page (``cuMemUnmap`` must cover whole mappings) and pools the handles.
* Footprint: the driver has no per-range query of physical memory, so
  :meth:`CudaRange.footprint_bytes` counts the handles actually mapped in this range times the
  page size (pooled handles excluded). ``cuMemGetInfo`` deltas (:meth:`CudaBackend.mem_get_info`)
  are the device-wide cross-check, with the driver's own overheads.

Strictness: uncommitted pages are unmapped, never backed by a shared zero page, so the backend is
strict by construction (``strict=False`` is refused). A stray kernel access to an uncommitted page
is an illegal-address fault, which on CUDA also poisons the process's context: later driver calls
fail with that sticky error and surface as :class:`DeviceFault`, never as a plain commit error.

Guarantees (docs/cuda.md states them for users):

* Zeroing: every newly committed page reads as zeros (``cuMemsetD8Async`` + a stream sync),
  pooled handles included, like the host backend; the driver itself does not zero memory.
* Synchronisation: before any unmap (release, close, collection) and before the address range is
  freed, the backend waits for the context (or the caller's ``sync_stream``), so kernels queued
  on the range finish before their memory goes away.
* Interrupts: a commit or release stopped by any exception (``KeyboardInterrupt`` too) undoes
  its partial work before the exception propagates, so bookkeeping and driver agree.
* Peers: access is granted to the owning device only; other GPUs cannot read the range.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING

from elastickv.vmm.base import DEFAULT_PAGE_SIZE, VirtualRange, VmmBackend, round_up
from elastickv.vmm.cuda_driver import CudaDriver, CudaDriverError, DriverApi
from elastickv.vmm.errors import (
    BackendUnavailable,
    CommitError,
    DeviceFault,
    OutOfPhysicalMemory,
    ReleaseError,
    ReservationError,
    VmmError,
)

if TYPE_CHECKING:
    import torch

DEFAULT_HANDLE_POOL_SIZE = 8


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _device_fault(exc: CudaDriverError, what: str) -> DeviceFault:
    """A sticky fault: say what failed, why that usually happens and that only a restart helps."""
    return DeviceFault(
        f"{what} failed: {exc}; the CUDA context is lost after an earlier fault (most often a "
        "kernel touched an uncommitted page of a strict range, or a page released while a "
        "kernel still used it); no later call can succeed, restart the process and find the "
        "kernel with CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer"
    )


def _commit_error(exc: CudaDriverError, what: str) -> VmmError:
    """DeviceFault for a sticky fault, OutOfPhysicalMemory for CUDA_ERROR_OUT_OF_MEMORY,
    CommitError for anything else."""
    if exc.context_lost:
        return _device_fault(exc, what)
    if exc.out_of_memory:
        return OutOfPhysicalMemory(
            f"no device memory for {what}: {exc}; free blocks, trim handle pools or lower "
            "the KV budget (other processes on the GPU count too)"
        )
    return CommitError(f"{what} failed: {exc}")


class HandlePool:
    """Idle physical allocations of one page each, kept for reuse up to ``limit``.

    Not thread safe on its own: the owning range calls it under its lock.
    """

    def __init__(self, driver: DriverApi, page_size: int, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"handle_pool_size must be an int >= 0, got {limit!r}")
        self._driver = driver
        self._page_size = page_size
        self._limit = limit
        self._idle: list[int] = []
        self.created = 0
        self.reused = 0

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def idle(self) -> int:
        return len(self._idle)

    def take(self, count: int) -> list[int]:
        """``count`` handles, pooled ones first; all or nothing (raises CommitError)."""
        reused = min(count, len(self._idle))
        handles = [self._idle.pop() for _ in range(reused)]
        try:
            while len(handles) < count:
                handles.append(self._driver.create(self._page_size))
                self.created += 1
        except CudaDriverError as exc:
            error = _commit_error(exc, f"creating a {_mib(self._page_size)} physical page")
            self.restock(handles, error)
            raise error from exc
        except BaseException as exc:
            self.restock(handles, exc)
            raise
        self.reused += reused
        return handles

    def put(self, handles: list[int]) -> int:
        """Keep up to ``limit`` idle handles and release the rest; returns how many the driver
        refused to release.

        A refused handle stays pooled, so :meth:`drain` retries it and reports the error; the
        pages it came from are unmapped either way.
        """
        room = max(self._limit - len(self._idle), 0)
        self._idle.extend(handles[:room])
        refused = 0
        for handle in handles[room:]:
            try:
                self._driver.release(handle)
            except CudaDriverError:
                self._idle.append(handle)
                refused += 1
        return refused

    def restock(self, handles: list[int], error: BaseException) -> None:
        """:meth:`put` on an error path: a refused release becomes a note on ``error``."""
        if self.put(handles):
            error.add_note("some physical handles could not be released and stay pooled")

    def fill(self, count: int) -> int:
        """Create handles until ``count`` (at most ``limit``) are idle; returns how many."""
        target = min(count, self._limit)
        made = 0
        while len(self._idle) < target:
            try:
                self._idle.append(self._driver.create(self._page_size))
            except CudaDriverError as exc:
                raise _commit_error(exc, f"pre-creating {target} pooled pages") from exc
            self.created += 1
            made += 1
        return made

    def drain(self) -> list[CudaDriverError]:
        """Release every idle handle; returns the errors (the failed handles are dropped)."""
        errors: list[CudaDriverError] = []
        while self._idle:
            handle = self._idle.pop()
            try:
                self._driver.release(handle)
            except CudaDriverError as exc:
                errors.append(exc)
        return errors


class _Reservation:
    """Address space that is freed when its last holder (range or tensor) lets go."""

    def __init__(self, driver: DriverApi, address: int, size: int) -> None:
        self.driver = driver
        self.address = address
        self.size = size
        self._finalizer = weakref.finalize(self, _free_address, driver, address, size)
        self._finalizer.atexit = False


def _free_address(driver: DriverApi, address: int, size: int) -> None:
    """Finalizer: wait for queued kernels, then free; nothing useful can be done with an error."""
    try:
        with driver.current():
            driver.synchronize(None)
            driver.address_free(address, size)
    except Exception:
        return


def _unmap_all(
    driver: DriverApi, base: int, page_size: int, handles: dict[int, int], pool: HandlePool
) -> None:
    """Finalizer of a range that was never closed: return its device memory, ignore errors."""
    try:
        with driver.current():
            driver.synchronize(None)
            for page, handle in list(handles.items()):
                try:
                    driver.unmap(base + page * page_size, page_size)
                    driver.release(handle)
                except CudaDriverError:
                    continue
            handles.clear()
            pool.drain()
    except Exception:
        return


class CudaRange(VirtualRange):
    """A reserved device range; page ``i`` is backed by its own physical handle when committed."""

    backend_name = "cuda"

    def __init__(
        self,
        driver: DriverApi,
        *,
        size_bytes: int,
        page_size: int,
        granularity: int,
        pool: int,
        sync_stream: int | None = None,
    ) -> None:
        # The driver takes a power-of-two alignment only, so a page size like 6 MiB reserves
        # page_size - granularity bytes more at the driver's own (granularity) alignment and
        # starts page 0 at the first page-size multiple inside.
        aligned = page_size & (page_size - 1) == 0
        span = size_bytes if aligned else size_bytes + page_size - granularity
        try:
            with driver.current():
                raw = driver.address_reserve(span, page_size if aligned else 0)
        except CudaDriverError as exc:
            raise ReservationError(
                f"reserving {_mib(size_bytes)} of device address space failed: {exc}; "
                "reserve less or close unused ranges"
            ) from exc
        super().__init__(
            base_address=round_up(raw, page_size),
            size_bytes=size_bytes,
            page_size=page_size,
            strict=True,
        )
        self._driver = driver
        self._stream = sync_stream
        self._reservation: _Reservation | None = _Reservation(driver, raw, span)
        self._pool = HandlePool(driver, page_size, pool)
        self._handles: dict[int, int] = {}
        self._stuck: dict[int, int] = {}
        self._finalizer = weakref.finalize(
            self, _unmap_all, driver, self.base_address, page_size, self._handles, self._pool
        )
        self._finalizer.atexit = False
        self.set_access_calls = 0

    @property
    def device(self) -> int:
        return self._driver.device

    @property
    def pool(self) -> HandlePool:
        return self._pool

    def footprint_bytes(self) -> int:
        """Device bytes mapped in this range (handles mapped x page size; pool excluded).

        The driver has no per-range physical-memory query; this counts what the driver accepted
        (successful ``cuMemMap`` minus successful ``cuMemUnmap``), including any page whose
        unmap failed and is still mapped. Cross-check device-wide with ``cuMemGetInfo``.
        """
        return (len(self._handles) + len(self._stuck)) * self.page_size

    def held_bytes(self) -> int:
        """Device bytes this range holds: mapped pages plus idle pooled handles."""
        return self.footprint_bytes() + self._pool.idle * self.page_size

    def fill_pool(self, count: int) -> int:
        """Pre-create up to ``count`` handles (bounded by the pool size) so commits skip
        ``cuMemCreate``; returns how many were created."""
        with self._lock:
            self._check_open()
            with self._driver.current():
                return self._pool.fill(count)

    def trim_pool(self) -> int:
        """Release every idle pooled handle; returns the bytes given back."""
        with self._lock:
            self._check_open()
            idle = self._pool.idle
            with self._driver.current():
                errors = self._pool.drain()
            if errors:
                raise ReleaseError(f"releasing pooled handles failed: {errors[0]}")
            return idle * self.page_size

    def as_tensor(self) -> torch.Tensor:
        """Flat ``uint8`` CUDA tensor over the whole range, zero copy (via DLPack).

        The tensor keeps the address range reserved even after :meth:`close`, so a stale tensor
        hits unmapped memory (an illegal-address fault) instead of someone else's allocation.
        """
        from elastickv.vmm.cuda_dlpack import KDL_CUDA, byte_tensor

        with self._lock:
            self._check_open()
            return byte_tensor(
                self.base_address,
                self.size_bytes,
                device_type=KDL_CUDA,
                device_id=self._driver.device,
                keepalive=self._reservation,
            )

    def _address(self, page: int) -> int:
        return self.base_address + page * self.page_size

    def _commit_run(self, first: int, count: int) -> None:
        size = self.page_size
        what = f"{count} page(s) ({_mib(count * size)}) at page {first}"
        with self._driver.current():
            handles = self._pool.take(count)
            mapped = 0
            try:
                for handle in handles:
                    self._driver.map(self._address(first + mapped), size, handle)
                    mapped += 1
                self.set_access_calls += 1
                self._driver.set_access(self._address(first), count * size)
                self._driver.zero(self._address(first), count * size, self._stream)
            except CudaDriverError as exc:
                error = _commit_error(exc, f"mapping {what}")
                self._undo_maps(first, handles[:mapped], error)
                self._pool.restock(handles[mapped:], error)
                raise error from exc
            except BaseException as exc:
                # Interrupted (KeyboardInterrupt...): the map in flight may or may not have
                # happened, so its page is unmapped on trial too.
                in_flight = handles[mapped : mapped + 1]
                self._undo_maps(first, handles[:mapped], exc, maybe=in_flight)
                self._pool.restock(handles[mapped + len(in_flight) :], exc)
                raise
        for offset, handle in enumerate(handles):
            self._handles[first + offset] = handle

    def _undo_maps(
        self, first: int, handles: list[int], error: BaseException, maybe: list[int] | None = None
    ) -> None:
        """Unmap the pages of a failed commit and pool their handles.

        ``maybe`` holds the handle of a map that was interrupted: unmapping its page fails if
        the map never happened, and either way the handle is free again.
        """
        back: list[int] = []
        for offset, handle in enumerate(handles):
            try:
                self._driver.unmap(self._address(first + offset), self.page_size)
            except CudaDriverError as exc:
                self._stuck[first + offset] = handle
                error.add_note(f"page {first + offset} could not be unmapped again: {exc}")
                continue
            back.append(handle)
        for handle in maybe or []:
            with contextlib.suppress(CudaDriverError):  # fails if the map never happened
                self._driver.unmap(self._address(first + len(handles)), self.page_size)
            back.append(handle)
        self._pool.restock(back, error)

    def _release_run(self, first: int, count: int) -> None:
        size = self.page_size
        pages = f"pages {first}..{first + count - 1}"
        done = 0
        with self._driver.current():
            try:
                self._driver.synchronize(self._stream)
            except CudaDriverError as exc:
                error = _release_error(exc, f"waiting for queued work before unmapping {pages}")
                raise error from exc
            try:
                for page in range(first, first + count):
                    self._driver.unmap(self._address(page), size)
                    done += 1
            except CudaDriverError as exc:
                error = _release_error(exc, f"unmapping page {first + done}")
                self._restore(first, done, error)
                raise error from exc
            except BaseException as exc:
                self._restore(first, done, exc, interrupted=done < count)
                raise
            handles = [self._handles.pop(page) for page in range(first, first + count)]
            self._pool.put(handles)

    def _restore(
        self, first: int, count: int, error: BaseException, *, interrupted: bool = False
    ) -> None:
        """Map back the pages a failed release already unmapped, so the run stays committed.

        ``interrupted``: the unmap of page ``first + count`` was in flight; it is mapped again
        if it went, and left alone if it did not (the map then fails, as the page is mapped).
        """
        if not count and not interrupted:
            return
        try:
            for page in range(first, first + count):
                self._driver.map(self._address(page), self.page_size, self._handles[page])
            if interrupted:
                page = first + count
                # Fails if the interrupted unmap never happened: the page is still mapped.
                with contextlib.suppress(CudaDriverError):
                    self._driver.map(self._address(page), self.page_size, self._handles[page])
                count += 1
            self._driver.set_access(self._address(first), count * self.page_size)
        except CudaDriverError as exc:
            error.add_note(f"re-mapping pages {first}..{first + count - 1} failed too: {exc}")

    def _teardown(self) -> None:
        self._finalizer.detach()
        errors: list[CudaDriverError] = []
        with self._driver.current():
            try:
                self._driver.synchronize(self._stream)
            except CudaDriverError as exc:
                errors.append(exc)
            leftovers = {**self._handles, **self._stuck}
            self._handles.clear()
            self._stuck.clear()
            for page, handle in sorted(leftovers.items()):
                try:
                    self._driver.unmap(self._address(page), self.page_size)
                    self._driver.release(handle)
                except CudaDriverError as exc:
                    errors.append(exc)
            errors.extend(self._pool.drain())
        self._reservation = None
        if errors:
            what = f"closing the CUDA range left {len(errors)} handle(s) unreleased"
            if any(e.context_lost for e in errors):
                raise _device_fault(next(e for e in errors if e.context_lost), what)
            raise ReleaseError(f"{what}: {errors[0]}")


def _release_error(exc: CudaDriverError, what: str) -> VmmError:
    """DeviceFault for a sticky fault, else a ReleaseError that says the run stays committed."""
    if exc.context_lost:
        return _device_fault(exc, what)
    return ReleaseError(f"{what} failed: {exc}; the pages stay committed, retry the release")


class CudaBackend(VmmBackend):
    """CUDA VMM backend on one device (always strict: see the module docstring).

    ``handle_pool_size`` bounds the idle physical handles each range keeps for reuse
    (0 disables pooling). ``sync_stream`` (a ``CUstream`` address) is the stream the backend
    waits on before unmapping and zeroes new pages on; ``None`` waits for the whole context and
    zeroes on the legacy default stream. ``driver`` replaces the real driver (tests use a fake).
    """

    name = "cuda"
    device_type = "cuda"

    def __init__(
        self,
        device: int = 0,
        page_size: int = DEFAULT_PAGE_SIZE,
        *,
        strict: bool = True,
        handle_pool_size: int = DEFAULT_HANDLE_POOL_SIZE,
        sync_stream: int | None = None,
        driver: DriverApi | None = None,
    ) -> None:
        if not strict:
            raise ValueError(
                "the CUDA backend is always strict: uncommitted pages are unmapped and there is "
                "no read-only zero page; pass strict=True"
            )
        if isinstance(handle_pool_size, bool) or not isinstance(handle_pool_size, int):
            raise ValueError(f"handle_pool_size must be an int, got {handle_pool_size!r}")
        if handle_pool_size < 0:
            raise ValueError(f"handle_pool_size must be >= 0, got {handle_pool_size}")
        self._driver: DriverApi = driver if driver is not None else CudaDriver(device)
        try:
            with self._driver.current():
                granularity = self._driver.granularity()
        except CudaDriverError as exc:
            raise BackendUnavailable(
                f"CUDA device {device} cannot report its VMM granularity: {exc}; the device "
                "may not support virtual memory management"
            ) from exc
        super().__init__(page_size=page_size, granularity=granularity, strict=True)
        self._handle_pool_size = handle_pool_size
        self._sync_stream = sync_stream

    @staticmethod
    def is_available(device: int = 0) -> bool:
        try:
            CudaBackend(device)
        except BackendUnavailable:
            return False
        return True

    @property
    def device(self) -> int:
        return self._driver.device

    @property
    def driver(self) -> DriverApi:
        return self._driver

    @property
    def handle_pool_size(self) -> int:
        return self._handle_pool_size

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` device bytes from ``cuMemGetInfo`` (device-wide, all processes)."""
        try:
            with self._driver.current():
                return self._driver.mem_get_info()
        except CudaDriverError as exc:
            raise VmmError(f"querying device memory failed: {exc}") from exc

    def reserve(self, size_bytes: int) -> CudaRange:
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0:
            raise ValueError(f"size_bytes must be a positive int, got {size_bytes!r}")
        return CudaRange(
            self._driver,
            size_bytes=round_up(size_bytes, self.page_size),
            page_size=self.page_size,
            granularity=self.granularity,
            pool=self._handle_pool_size,
            sync_stream=self._sync_stream,
        )
