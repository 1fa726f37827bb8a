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
  page size (pooled handles and the zero page excluded). ``cuMemGetInfo`` deltas
  (:meth:`CudaBackend.mem_get_info`) are the device-wide cross-check, with the driver's own
  overheads.

Uncommitted pages (``CudaBackend(uncommitted=...)``):

* ``"zero"`` (the default, for serving): every uncommitted page maps the range's one shared
  zero page (:mod:`elastickv.vmm.cuda_zero`), so a stray read sees zeros instead of faulting.
  On CUDA a fault poisons the process's context and the engine dies, so a read that strays past
  the blocks it was given must not be fatal. A stray write must not be shared silently between
  blocks through that page: the zero page is read-only where the driver accepts that (the write
  is an illegal-address fault, reported as :class:`DeviceFault`), else read-write with
  :meth:`CudaRange.check_zero_page` reporting (and undoing) any write. Commit swaps the zero page
  out for a real page, release swaps it back; both wait for queued work first, because a stray
  reader may be running on the zero mapping that goes away. Cost: one device page per range, one
  map per page at reserve time plus one set-access for the whole range, one more unmap per page
  on commit and one more map per page (and set-access per run) on release. The range is not
  ``strict``: a read does not fault.
* ``"fault"`` (strict, for tests and debugging): uncommitted pages are unmapped, so any access
  is an illegal-address fault, which poisons the context: later driver calls fail with that
  sticky error and surface as :class:`DeviceFault`, never as a plain commit error.

Guarantees (docs/cuda.md states them for users):

* Zeroing: every newly committed page reads as zeros (``cuMemsetD8Async`` + a stream sync),
  pooled handles included, like the host backend; the driver itself does not zero memory.
* Synchronisation: before any unmap (release, close, collection, and a commit that swaps out the
  zero page) and before the address range is freed, the backend waits for the context (or the
  caller's ``sync_stream``), so kernels queued on the range finish before their mapping goes.
* Interrupts: a commit or release stopped by any exception (``KeyboardInterrupt`` too) undoes
  its partial work before the exception propagates, so bookkeeping and driver agree.
* Peers: access is granted to the owning device only; other GPUs cannot read the range.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Literal, get_args

from elastickv.vmm.base import (
    DEFAULT_PAGE_SIZE,
    VirtualRange,
    VmmBackend,
    page_runs,
    round_up,
)
from elastickv.vmm.cuda_driver import CudaDriver, CudaDriverError, DriverApi
from elastickv.vmm.cuda_zero import ZeroPage
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

Uncommitted = Literal["zero", "fault"]
"""What an uncommitted page is: the shared zero page (reads see zeros) or nothing (faults)."""
UNCOMMITTED_MODES: tuple[Uncommitted, ...] = get_args(Uncommitted)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _device_fault(exc: CudaDriverError, what: str) -> DeviceFault:
    """A sticky fault: say what failed, why that usually happens and that only a restart helps."""
    return DeviceFault(
        f"{what} failed: {exc}; the CUDA context is lost after an earlier fault (most often a "
        "kernel wrote to an uncommitted page, read one of a strict range, or used a page "
        "released while it still ran); no later call can succeed, restart the process and find "
        "the kernel with CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer"
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

    def free_now(self) -> None:
        """Free the address range at once (nothing may be mapped in it)."""
        self._finalizer()


def _free_address(driver: DriverApi, address: int, size: int) -> None:
    """Finalizer: wait for queued kernels, then free; nothing useful can be done with an error."""
    try:
        with driver.current():
            driver.synchronize(None)
            driver.address_free(address, size)
    except Exception:
        return


class _Backing:
    """What a range holds in the driver, page by page.

    Shared with the range's finalizer, so it never refers to the range itself. ``handles``: the
    committed pages' physical handles; ``stuck``: pages whose unmap failed during a rollback
    (still mapped); ``holes`` (zero mode): pages with nothing mapped, after a zero-page map that
    failed during a rollback or once the range is closing; every other page maps ``zero``.
    """

    def __init__(
        self, driver: DriverApi, base: int, page_size: int, num_pages: int, pool: HandlePool
    ) -> None:
        self.driver = driver
        self.base = base
        self.page_size = page_size
        self.num_pages = num_pages
        self.pool = pool
        self.handles: dict[int, int] = {}
        self.stuck: dict[int, int] = {}
        self.holes: set[int] = set()
        self.zero: ZeroPage | None = None

    def address(self, page: int) -> int:
        return self.base + page * self.page_size

    def zero_mapped_runs(self) -> list[tuple[int, int]]:
        """``(first, count)`` runs of the pages that map the zero page now."""
        if self.zero is None:
            return []
        taken = self.handles.keys() | self.stuck.keys() | self.holes
        return page_runs([page for page in range(self.num_pages) if page not in taken])

    def give_back(self) -> list[CudaDriverError]:
        """Unmap and release everything; returns the driver's refusals. The caller has made the
        context current and waited for queued work."""
        errors: list[CudaDriverError] = []
        zero_runs = self.zero_mapped_runs()
        leftovers = {**self.handles, **self.stuck}
        self.handles.clear()
        self.stuck.clear()
        for page, handle in sorted(leftovers.items()):
            try:
                self.driver.unmap(self.address(page), self.page_size)
                self.driver.release(handle)
            except CudaDriverError as exc:
                errors.append(exc)
        if self.zero is not None:
            for first, count in zero_runs:
                errors.extend(self._unmap_zero_run(first, count))
            self.holes.update(range(self.num_pages))
            try:
                self.zero.close()
            except CudaDriverError as exc:
                errors.append(exc)
            self.zero = None
        errors.extend(self.pool.drain())
        return errors

    def _unmap_zero_run(self, first: int, count: int) -> list[CudaDriverError]:
        """One unmap for a run of zero mappings (the driver takes a range made of whole
        mappings); page by page if it refuses that."""
        try:
            self.driver.unmap(self.address(first), count * self.page_size)
        except CudaDriverError as exc:
            if exc.context_lost or count == 1:
                return [exc]
        else:
            return []
        errors: list[CudaDriverError] = []
        for page in range(first, first + count):
            try:
                self.driver.unmap(self.address(page), self.page_size)
            except CudaDriverError as exc:
                errors.append(exc)
        return errors


def _give_back(backing: _Backing) -> None:
    """Finalizer of a range that was never closed: return its device memory, ignore errors."""
    try:
        with backing.driver.current():
            backing.driver.synchronize(None)
            backing.give_back()
    except Exception:
        return


class CudaRange(VirtualRange):
    """A reserved device range; page ``i`` is backed by its own physical handle when committed,
    and maps the range's shared zero page (zero mode) or nothing (fault mode) when not."""

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
        uncommitted: Uncommitted = "zero",
    ) -> None:
        # The driver takes a power-of-two alignment only, so a page size like 6 MiB reserves
        # page_size - granularity bytes more at the driver's own (granularity) alignment and
        # starts page 0 at the first page-size multiple inside. Zero mode reserves one page more
        # past the range: the zero page's window, where it is always mapped (and checked).
        aligned = page_size & (page_size - 1) == 0
        window = page_size if uncommitted == "zero" else 0
        span = size_bytes + window + (0 if aligned else page_size - granularity)
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
            strict=uncommitted == "fault",
        )
        self._driver = driver
        self._stream = sync_stream
        self._uncommitted: Uncommitted = uncommitted
        self._reservation: _Reservation | None = _Reservation(driver, raw, span)
        self._pool = HandlePool(driver, page_size, pool)
        self._backing = _Backing(driver, self.base_address, page_size, self.num_pages, self._pool)
        self._handles = self._backing.handles
        self._stuck = self._backing.stuck
        self._holes = self._backing.holes
        if uncommitted == "zero":
            try:
                self._map_zero_page(self.base_address + size_bytes)
            except BaseException:
                self._reservation.free_now()
                self._reservation = None
                self._closed = True
                raise
        self._finalizer = weakref.finalize(self, _give_back, self._backing)
        self._finalizer.atexit = False
        self.set_access_calls = 0

    def _map_zero_page(self, window: int) -> None:
        """Create the zero page and map it at every page of the range (reserve time)."""
        what = f"mapping a zero page over {self.num_pages} page(s) of {_mib(self.page_size)}"
        try:
            with self._driver.current():
                zero = ZeroPage.create(self._driver, self.page_size, window, self._stream)
                try:
                    zero.map_run(self.base_address, self.num_pages)
                except BaseException:
                    with contextlib.suppress(CudaDriverError):
                        zero.close()
                    raise
        except CudaDriverError as exc:
            if exc.context_lost:
                raise _device_fault(exc, what) from exc
            raise ReservationError(
                f"{what} failed: {exc}; free device memory, or reserve with "
                "uncommitted='fault' (no zero page: any access to an uncommitted page faults)"
            ) from exc
        self._backing.zero = zero

    # -- description -------------------------------------------------------------------------

    @property
    def device(self) -> int:
        return self._driver.device

    @property
    def pool(self) -> HandlePool:
        return self._pool

    @property
    def uncommitted(self) -> Uncommitted:
        """``"zero"``: uncommitted pages map the shared zero page; ``"fault"``: nothing."""
        return self._uncommitted

    @property
    def zero_page_read_only(self) -> bool | None:
        """Whether the zero page is read-only (a stray write faults) or read-write (a stray
        write is found by :meth:`check_zero_page`); ``None`` without a zero page."""
        zero = self._backing.zero
        return None if zero is None else zero.read_only

    @property
    def zero_page_refusal(self) -> str | None:
        """The driver's refusal of read-only access, when the zero page had to be read-write."""
        zero = self._backing.zero
        return None if zero is None else zero.refusal

    @property
    def zero_page_writes(self) -> int:
        """How many times :meth:`check_zero_page` found the zero page written."""
        zero = self._backing.zero
        return 0 if zero is None else zero.writes

    def footprint_bytes(self) -> int:
        """Device bytes mapped in this range (handles mapped x page size; pool and zero page
        excluded).

        The driver has no per-range physical-memory query; this counts what the driver accepted
        (successful ``cuMemMap`` minus successful ``cuMemUnmap``), including any page whose
        unmap failed and is still mapped. Cross-check device-wide with ``cuMemGetInfo``.
        """
        return (len(self._handles) + len(self._stuck)) * self.page_size

    def zero_page_bytes(self) -> int:
        """Device bytes of the shared zero page (one page in zero mode, else 0)."""
        return 0 if self._backing.zero is None else self.page_size

    def held_bytes(self) -> int:
        """Device bytes this range holds: mapped pages, idle pooled handles and the zero page."""
        return self.footprint_bytes() + self._pool.idle * self.page_size + self.zero_page_bytes()

    # -- operations --------------------------------------------------------------------------

    def check_zero_page(self) -> bool:
        """Whether a kernel wrote to the shared zero page since the last check; if so it is
        zeroed again, counted in :attr:`zero_page_writes`, and the caller should report a
        stray write (some kernel wrote to an uncommitted block). Always ``False`` without a
        zero page.

        Cheap enough to run every few engine steps: a wait for queued work and one page-sized
        device-to-host copy. With a read-only zero page a write faults instead, so this only
        confirms the driver enforced it.
        """
        with self._lock:
            self._check_open()
            zero = self._backing.zero
            if zero is None:
                return False
            try:
                with self._driver.current():
                    return zero.check()
            except CudaDriverError as exc:
                if exc.context_lost:
                    raise _device_fault(exc, "checking the zero page") from exc
                raise VmmError(f"checking the zero page failed: {exc}") from exc

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

    # -- commit ------------------------------------------------------------------------------

    def _commit_run(self, first: int, count: int) -> None:
        size = self.page_size
        what = f"{count} page(s) ({_mib(count * size)}) at page {first}"
        zero = self._backing.zero
        with self._driver.current():
            if zero is not None:
                # A stray reader may be queued on the zero mappings this commit takes away.
                try:
                    self._driver.synchronize(self._stream)
                except CudaDriverError as exc:
                    what = f"waiting for queued work before mapping {what}"
                    raise _commit_error(exc, what) from exc
            handles = self._pool.take(count)
            cleared = 0
            mapped = 0
            try:
                if zero is not None:
                    for page in range(first, first + count):
                        if page not in self._holes:
                            self._driver.unmap(self._address(page), size)
                        cleared += 1
                for handle in handles:
                    self._driver.map(self._address(first + mapped), size, handle)
                    mapped += 1
                self.set_access_calls += 1
                self._driver.set_access(self._address(first), count * size)
                self._driver.zero(self._address(first), count * size, self._stream)
            except CudaDriverError as exc:
                error = _commit_error(exc, f"mapping {what}")
                self._undo_commit(first, handles, mapped, cleared, error)
                raise error from exc
            except BaseException as exc:
                # Interrupted (KeyboardInterrupt...): the driver call in flight may or may not
                # have happened, so its page is undone on trial too.
                self._undo_commit(first, handles, mapped, cleared, exc, interrupted=True)
                raise
        for offset, handle in enumerate(handles):
            self._handles[first + offset] = handle
        self._holes.difference_update(range(first, first + count))

    def _undo_commit(
        self,
        first: int,
        handles: list[int],
        mapped: int,
        cleared: int,
        error: BaseException,
        *,
        interrupted: bool = False,
    ) -> None:
        """Put a failed commit's pages back as they were: real pages unmapped and pooled, and in
        zero mode the zero page mapped again where this commit had unmapped it."""
        count = len(handles)
        clearing = self._backing.zero is not None and cleared < count
        in_flight = handles[mapped : mapped + 1] if interrupted and not clearing else []
        self._undo_maps(first, handles[:mapped], error, maybe=in_flight)
        self._pool.restock(handles[mapped + len(in_flight) :], error)
        if self._backing.zero is not None:
            maybe_mapped = {first + cleared} if interrupted and clearing else set()
            pages = list(range(first, first + cleared)) + sorted(maybe_mapped)
            self._remap_zero([p for p in pages if p not in self._stuck], error, maybe_mapped)

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

    def _remap_zero(self, pages: list[int], error: BaseException, maybe_mapped: set[int]) -> None:
        """Map the zero page again at ``pages`` (after a failed commit) and grant its access per
        contiguous run. A page in ``maybe_mapped`` may still map it (an interrupted unmap), so a
        refused map there is expected; any other refusal leaves a hole (a stray access there
        faults) and a note on ``error``."""
        zero = self._backing.zero
        assert zero is not None
        done: list[int] = []
        for page in pages:
            try:
                self._driver.map(self._address(page), self.page_size, zero.handle)
            except CudaDriverError as exc:
                if page not in maybe_mapped:
                    self._holes.add(page)
                    error.add_note(f"the zero page could not be mapped at page {page}: {exc}")
                    continue
            self._holes.discard(page)
            done.append(page)
        for run_first, run_count in page_runs(sorted(done)):
            try:
                self._driver.set_access(
                    self._address(run_first), run_count * self.page_size, read_only=zero.read_only
                )
            except CudaDriverError as exc:
                error.add_note(
                    f"access to the zero page at pages {run_first}..{run_first + run_count - 1} "
                    f"could not be granted again (a stray access there faults): {exc}"
                )

    # -- release -----------------------------------------------------------------------------

    def _release_run(self, first: int, count: int) -> None:
        size = self.page_size
        pages = f"pages {first}..{first + count - 1}"
        # Closing: these pages get no zero mapping, the teardown would only unmap it again.
        zero = None if self._closed else self._backing.zero
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
                if zero is not None:
                    zero.map_run(self._address(first), count)
            except CudaDriverError as exc:
                what = (
                    f"unmapping page {first + done}"
                    if done < count
                    else (f"mapping the zero page over {pages}")
                )
                error = _release_error(exc, what)
                self._restore(first, done, error)
                raise error from exc
            except BaseException as exc:
                self._restore(first, done, exc, interrupted=done < count)
                raise
            handles = [self._handles.pop(page) for page in range(first, first + count)]
            self._pool.put(handles)
        if zero is None and self._backing.zero is not None:
            self._holes.update(range(first, first + count))

    def _restore(
        self, first: int, count: int, error: BaseException, *, interrupted: bool = False
    ) -> None:
        """Map back the pages a failed release already unmapped, so the run stays committed.

        ``interrupted``: the unmap of page ``first + count`` was in flight; it is mapped again
        if it went, and left alone if it did not (the map then fails, as the page is mapped).
        A zero page mapped over the run was already unmapped again (:meth:`ZeroPage.map_run` is
        all or nothing).
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

    # -- close -------------------------------------------------------------------------------

    def _teardown(self) -> None:
        self._finalizer.detach()
        errors: list[CudaDriverError] = []
        with self._driver.current():
            try:
                self._driver.synchronize(self._stream)
            except CudaDriverError as exc:
                errors.append(exc)
            errors.extend(self._backing.give_back())
        self._reservation = None
        if errors:
            what = f"closing the CUDA range left {len(errors)} mapping(s) or handle(s) unreleased"
            if any(e.context_lost for e in errors):
                raise _device_fault(next(e for e in errors if e.context_lost), what)
            raise ReleaseError(f"{what}: {errors[0]}")


def _release_error(exc: CudaDriverError, what: str) -> VmmError:
    """DeviceFault for a sticky fault, else a ReleaseError that says the run stays committed."""
    if exc.context_lost:
        return _device_fault(exc, what)
    return ReleaseError(f"{what} failed: {exc}; the pages stay committed, retry the release")


class CudaBackend(VmmBackend):
    """CUDA VMM backend on one device.

    ``uncommitted`` says what an uncommitted page is (see the module docstring): ``"zero"``
    (default) maps the range's shared zero page there, so a stray read sees zeros and a stray
    write is reported; ``"fault"`` leaves it unmapped, so any access faults (``strict``).
    ``strict=True`` / ``False`` is the same choice spelled as the host backend spells it.
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
        uncommitted: Uncommitted | None = None,
        strict: bool | None = None,
        handle_pool_size: int = DEFAULT_HANDLE_POOL_SIZE,
        sync_stream: int | None = None,
        driver: DriverApi | None = None,
    ) -> None:
        mode = _uncommitted_mode(uncommitted, strict)
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
        super().__init__(page_size=page_size, granularity=granularity, strict=mode == "fault")
        self._uncommitted: Uncommitted = mode
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

    @property
    def uncommitted(self) -> Uncommitted:
        return self._uncommitted

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
            uncommitted=self._uncommitted,
        )


def _uncommitted_mode(uncommitted: object, strict: object) -> Uncommitted:
    """The mode from ``uncommitted`` and its spelling as ``strict``; a clash is an error."""
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"strict must be True, False or None, got {strict!r}")
    if uncommitted is not None and uncommitted not in UNCOMMITTED_MODES:
        raise ValueError(
            f"uncommitted must be one of {', '.join(map(repr, UNCOMMITTED_MODES))}, got "
            f"{uncommitted!r}: 'zero' maps a shared zero page under uncommitted pages (reads see "
            "zeros), 'fault' leaves them unmapped (any access faults)"
        )
    from_strict: Uncommitted | None = None if strict is None else ("fault" if strict else "zero")
    if uncommitted is not None and from_strict is not None and uncommitted != from_strict:
        raise ValueError(
            f"uncommitted={uncommitted!r} contradicts strict={strict!r} (strict=True is "
            "uncommitted='fault', strict=False is uncommitted='zero'); pass one of them"
        )
    if uncommitted == "fault" or from_strict == "fault":
        return "fault"
    return "zero"
