"""The shared zero page of a CUDA range: what its uncommitted pages map in the default mode.

Why it exists: an unmapped page faults on any access, and on CUDA one fault poisons the whole
context, so a serving engine dies of a single stray read (a kernel reading a tile past the
blocks it was given, a padded block table). So in the default mode (``uncommitted="zero"``)
every uncommitted page of a range maps this one physical page, created and zeroed once:
a stray read sees zeros and the engine lives.

A stray *write* must never be shared silently between blocks through that page. Where the
driver grants read-only access, the zero page is mapped read-only, so a stray store is an
illegal-address fault: loud, attributable, never aliased. Where the driver refuses read-only
access, it is mapped read-write and :meth:`ZeroPage.check` is the detector: it reads the page
back (through a window mapping that always exists), reports whether anything wrote to it and
zeroes it again. That fallback only *detects*: between a stray write and the next check, stray
readers of uncommitted pages see the written bytes.

Driver facts this relies on (sources in docs/cuda.md):

* one physical allocation may be mapped at many addresses: ``cuMemMap`` refuses an address that
  is already mapped, not a handle that is, and ``cuMemRelease`` frees memory only once "all
  outstanding mappings" are unmapped;
* every new mapping starts with no access (``cuMemUnmap``'s documentation), so the zero page
  needs ``cuMemSetAccess`` wherever it is mapped; one call covers a fully mapped run made of
  several mappings;
* ``CU_MEM_ACCESS_FLAGS_PROT_READ`` makes a range read-only for a device; writes there are
  invalid accesses (``CU_POINTER_ATTRIBUTE_ACCESS_FLAGS``), i.e. a sticky illegal-address fault.

Every driver error is raised as :class:`CudaDriverError`; the range translates it.
"""

from __future__ import annotations

import contextlib

from elastickv.vmm.cuda_driver import CudaDriverError, DriverApi


class ZeroPage:
    """One zeroed physical page mapped at ``window`` and wherever :meth:`map_run` puts it.

    Not thread safe on its own: the owning range calls it under its lock, with the driver's
    context current.
    """

    def __init__(
        self,
        driver: DriverApi,
        handle: int,
        page_size: int,
        window: int,
        stream: int | None,
        refusal: str | None,
    ) -> None:
        self._driver = driver
        self.handle = handle
        self.page_size = page_size
        self.window = window
        self._stream = stream
        self.refusal = refusal
        self.writes = 0
        self._zeros = bytes(page_size)

    @property
    def read_only(self) -> bool:
        """Whether the device may only read it (else a write is caught by :meth:`check`)."""
        return self.refusal is None

    @classmethod
    def create(cls, driver: DriverApi, page_size: int, window: int, stream: int | None) -> ZeroPage:
        """Create the page, map it at ``window`` (a reserved, unmapped page), zero it there and
        make it read-only if the driver accepts that. On any error nothing is left behind."""
        handle = driver.create(page_size)
        try:
            driver.map(window, page_size, handle)
            driver.set_access(window, page_size)
            driver.zero(window, page_size, stream)
            refusal = _refuse_writes(driver, window, page_size)
        except BaseException:
            # The map may or may not have happened (an interrupt): unmapping is tried either way.
            with contextlib.suppress(CudaDriverError):
                driver.unmap(window, page_size)
            with contextlib.suppress(CudaDriverError):
                driver.release(handle)
            raise
        return cls(driver, handle, page_size, window, stream, refusal)

    def map_run(self, address: int, count: int) -> None:
        """Map the page at ``count`` consecutive unmapped pages from ``address`` and grant its
        access over them with one call; all or nothing (the maps are undone on any error)."""
        size = self.page_size
        mapped = 0
        try:
            for _ in range(count):
                self._driver.map(address + mapped * size, size, self.handle)
                mapped += 1
            self._driver.set_access(address, count * size, read_only=self.read_only)
        except CudaDriverError as exc:
            self.unmap_pages(address, mapped, exc)
            raise
        except BaseException as exc:
            # Interrupted: the map in flight may have happened, so its page is unmapped on trial.
            self.unmap_pages(address, mapped, exc)
            if mapped < count:
                with contextlib.suppress(CudaDriverError):
                    self._driver.unmap(address + mapped * size, size)
            raise

    def unmap_pages(self, address: int, count: int, error: BaseException) -> None:
        """Unmap ``count`` pages from ``address`` one by one; a refusal becomes a note."""
        for index in range(count):
            try:
                self._driver.unmap(address + index * self.page_size, self.page_size)
            except CudaDriverError as exc:
                at = address + index * self.page_size
                error.add_note(f"the zero page at {at:#x} could not be unmapped again: {exc}")

    def check(self) -> bool:
        """Whether anything wrote to the page since it was last zeroed; if so it is zeroed again.

        Waits for queued work first (on the range's stream, else the whole context), then copies
        the page to the host: about one page-sized device-to-host copy per call.
        """
        self._driver.synchronize(self._stream)
        if self._driver.read(self.window, self.page_size) == self._zeros:
            return False
        self.writes += 1
        if self.read_only:
            self._driver.set_access(self.window, self.page_size)
        self._driver.zero(self.window, self.page_size, self._stream)
        if self.read_only:
            self._driver.set_access(self.window, self.page_size, read_only=True)
        return True

    def close(self) -> None:
        """Unmap the window and release the page (every other mapping must be gone)."""
        self._driver.unmap(self.window, self.page_size)
        self._driver.release(self.handle)


def _refuse_writes(driver: DriverApi, window: int, page_size: int) -> str | None:
    """Make the mapped window read-only; the driver's refusal text if it does not accept that.

    The same range just took read-write access, so a refusal here is about the read-only flag
    itself (``cuMemSetAccess`` documents CUDA_ERROR_INVALID_VALUE and CUDA_ERROR_NOT_SUPPORTED
    as its refusals); a lost context is not a refusal and propagates.
    """
    try:
        driver.set_access(window, page_size, read_only=True)
    except CudaDriverError as exc:
        if exc.context_lost:
            raise
        return str(exc)
    return None
