"""The backend interface shared by the host and CUDA virtual-memory backends.

A backend reserves a virtual range far larger than physical memory and commits or releases
physical memory under it page by page. The page bookkeeping, batching of contiguous runs,
rollback and locking live here once, so every backend (and the allocator above them) behaves
the same; a backend only supplies the per-run system calls.

Idempotency: ``commit`` of an already committed page and ``release`` of an uncommitted page are
no-ops. Both return how many pages actually changed state, so a caller that expects a change can
assert on it, and rollback paths can simply re-issue a call without tracking partial progress.
"""

from __future__ import annotations

import abc
import operator
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Self

from elastickv.vmm.errors import PageIndexError, PageSizeError, RangeClosedError, VmmError

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
DEFAULT_PAGE_SIZE = 2 * MiB


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def validate_page_size(page_size: int, granularity: int) -> int:
    """Return ``page_size`` if it is a positive multiple of ``granularity``, else raise."""
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise PageSizeError(
            f"page_size must be an int number of bytes, got {type(page_size).__name__}"
        )
    if page_size <= 0 or page_size % granularity != 0:
        suggestion = round_up(max(page_size, 1), granularity)
        raise PageSizeError(
            f"page_size {page_size} bytes is not a positive multiple of this backend's "
            f"granularity ({granularity} bytes); use e.g. {suggestion} or the default "
            f"{DEFAULT_PAGE_SIZE}"
        )
    return page_size


def page_runs(sorted_pages: list[int]) -> list[tuple[int, int]]:
    """Group sorted, unique page indices into ``(first, count)`` runs of consecutive pages."""
    runs: list[tuple[int, int]] = []
    if not sorted_pages:
        return runs
    first = prev = sorted_pages[0]
    for page in sorted_pages[1:]:
        if page != prev + 1:
            runs.append((first, prev - first + 1))
            first = page
        prev = page
    runs.append((first, prev - first + 1))
    return runs


@dataclass(frozen=True)
class RangeInfo:
    """Static description of a reserved range (what a log line or a peer process needs)."""

    backend: str
    base_address: int
    size_bytes: int
    page_size: int
    num_pages: int
    strict: bool


class VirtualRange(abc.ABC):
    """A reserved virtual range whose pages can be committed and released.

    Page ``i`` covers bytes ``[i * page_size, (i + 1) * page_size)`` of :meth:`as_tensor`.
    All state changes happen under one lock, so concurrent callers never see a half-updated
    bookkeeping. ``commit`` is all-or-nothing: if a run fails, the runs this call already
    committed are released again before the error propagates.
    """

    backend_name: ClassVar[str] = "abstract"

    def __init__(self, *, base_address: int, size_bytes: int, page_size: int, strict: bool):
        self._base_address = base_address
        self._size_bytes = size_bytes
        self._page_size = page_size
        self._num_pages = size_bytes // page_size
        self._strict = strict
        self._lock = threading.Lock()
        self._committed: set[int] = set()
        self._closed = False

    # -- description -------------------------------------------------------------------------

    @property
    def base_address(self) -> int:
        """Virtual address of page 0 (aligned to the page size)."""
        return self._base_address

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def bytes_per_page(self) -> int:
        """Physical bytes one committed page index holds: the page size here; a range that
        commits each index on several devices or ranks holds that many pages."""
        return self._page_size

    @property
    def strict(self) -> bool:
        """True if access to an uncommitted page faults (reads included)."""
        return self._strict

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def info(self) -> RangeInfo:
        return RangeInfo(
            backend=self.backend_name,
            base_address=self._base_address,
            size_bytes=self._size_bytes,
            page_size=self._page_size,
            num_pages=self._num_pages,
            strict=self._strict,
        )

    # -- page state --------------------------------------------------------------------------

    def commit(self, pages: Iterable[int]) -> int:
        """Make physical memory present under ``pages``; returns how many pages were newly
        committed. Already committed pages are skipped (no-op). Contiguous runs take one
        backend call each. On failure nothing committed by this call remains committed."""
        wanted = self._normalize(pages)
        with self._lock:
            self._check_open()
            todo = [p for p in wanted if p not in self._committed]
            done: list[tuple[int, int]] = []
            try:
                for first, count in page_runs(todo):
                    self._commit_run(first, count)
                    self._committed.update(range(first, first + count))
                    done.append((first, count))
            except BaseException as exc:
                self._roll_back(done, exc)
                raise
            return len(todo)

    def release(self, pages: Iterable[int]) -> int:
        """Return the physical memory under ``pages`` to the system; returns how many pages were
        released. Uncommitted pages are skipped (no-op). If a run fails, earlier runs stay
        released and the failed run stays committed, so the bookkeeping always tells the truth."""
        wanted = self._normalize(pages)
        with self._lock:
            self._check_open()
            todo = [p for p in wanted if p in self._committed]
            for first, count in page_runs(todo):
                self._release_run(first, count)
                self._committed.difference_update(range(first, first + count))
            return len(todo)

    def is_committed(self, page: int) -> bool:
        index = self._check_index(page)
        with self._lock:
            return index in self._committed

    def committed_pages(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._committed)

    @property
    def num_committed(self) -> int:
        return len(self._committed)

    def committed_bytes(self) -> int:
        """Bytes committed according to this range's bookkeeping (see :meth:`footprint_bytes`)."""
        return len(self._committed) * self.bytes_per_page

    @abc.abstractmethod
    def footprint_bytes(self) -> int:
        """Physical bytes held, as reported by the OS or driver (not by our own counter)."""

    @abc.abstractmethod
    def as_tensor(self) -> torch.Tensor:
        """Flat ``uint8`` tensor over the whole range, zero copy; valid while the range is open."""

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release every committed page and give the range back. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            failures: list[VmmError] = []
            for first, count in page_runs(sorted(self._committed)):
                try:
                    self._release_run(first, count)
                except VmmError as exc:
                    failures.append(exc)
            self._committed.clear()
            self._teardown()
        if failures:
            raise failures[0]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- backend hooks -----------------------------------------------------------------------

    @abc.abstractmethod
    def _commit_run(self, first: int, count: int) -> None:
        """Commit ``count`` pages from ``first``; on error leave none of them committed."""

    @abc.abstractmethod
    def _release_run(self, first: int, count: int) -> None:
        """Release ``count`` committed pages from ``first``."""

    @abc.abstractmethod
    def _teardown(self) -> None:
        """Free the reservation and backend resources; every page is already released."""

    # -- helpers -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RangeClosedError(
                f"this {self.backend_name} range was closed; reserve a new range to continue"
            )

    def _check_index(self, page: int) -> int:
        index = operator.index(page)
        if not 0 <= index < self._num_pages:
            raise PageIndexError(
                f"page index {index} is outside this range's pages 0..{self._num_pages - 1}"
            )
        return index

    def _normalize(self, pages: Iterable[int]) -> list[int]:
        if isinstance(pages, range) and pages.step == 1:
            wanted = list(pages)
        else:
            wanted = sorted({operator.index(p) for p in pages})
        if wanted:
            self._check_index(wanted[0])
            self._check_index(wanted[-1])
        return wanted

    def _roll_back(self, done: list[tuple[int, int]], cause: BaseException) -> None:
        for first, count in reversed(done):
            try:
                self._release_run(first, count)
            except VmmError as exc:
                cause.add_note(f"rollback of pages {first}..{first + count - 1} failed: {exc}")
                continue
            self._committed.difference_update(range(first, first + count))


class VmmBackend(abc.ABC):
    """Factory of :class:`VirtualRange` objects with one page size and strictness."""

    name: ClassVar[str] = "abstract"
    device_type: ClassVar[str] = "cpu"

    def __init__(self, *, page_size: int, granularity: int, strict: bool) -> None:
        self._granularity = granularity
        self._page_size = validate_page_size(page_size, granularity)
        self._strict = strict

    @property
    def granularity(self) -> int:
        """Smallest page size this backend can map."""
        return self._granularity

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def strict(self) -> bool:
        return self._strict

    def pages_for(self, size_bytes: int) -> int:
        """Number of pages a reservation of ``size_bytes`` gets (rounded up)."""
        return round_up(size_bytes, self._page_size) // self._page_size

    @abc.abstractmethod
    def reserve(self, size_bytes: int) -> VirtualRange:
        """Reserve ``size_bytes`` rounded up to whole pages, with nothing committed."""
