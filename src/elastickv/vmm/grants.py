"""Pages granted in one process and mapped in others: the scheduler decides, each worker maps.

Why this shape: a device mapping exists only in the address space of the process that made it
(on CUDA only the worker that owns the context can ``cuMemMap``), and an engine's workers may
run in other processes or on other hosts. So the process that places blocks (vLLM's
scheduler) keeps a :class:`PageGrants` range: it has no memory, and each commit or release of
its pages is recorded as an operation. The operations travel with the next step to every
worker (:class:`PageOps`, a tuple of ints), where a :class:`GrantFollower` applies them to the
worker's own range before the step runs. The allocator above :class:`PageGrants` is the same
code that drives a real range.

Ordering rules, each enforced here:

* Batches are numbered; a follower applies them in order and refuses a gap (a lost batch would
  leave a granted block unmapped).
* Commits apply at once: the batch arrives before the step that writes the new blocks.
* A release may still be read by work submitted before it (vLLM's asynchronous scheduling
  runs one step ahead), so the follower holds it until its ``fence`` says that work is done
  (on the host, a step's forward has returned before the next one starts: at once). A page
  granted again while its release waits simply stays mapped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastickv.vmm.base import VirtualRange, page_runs
from elastickv.vmm.errors import VmmError

if TYPE_CHECKING:
    import torch


class GrantOrderError(VmmError):
    """A worker received page operations out of order (a batch lost or repeated)."""


@dataclass(frozen=True)
class PageOps:
    """One batch of page operations, in the order the scheduler made them.

    ``runs`` holds ``(first, count)`` pairs flattened: a positive count commits ``count``
    pages from ``first``, a negative one releases ``-count`` pages. Plain ints, so the batch
    pickles small and survives every vLLM executor's transport."""

    seq: int
    runs: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.runs) % 2:
            raise ValueError(f"page operations come in (first, count) pairs, got {self.runs}")

    def items(self) -> Iterable[tuple[int, int]]:
        runs = self.runs
        return zip(runs[0::2], runs[1::2], strict=True)

    @property
    def committed_pages(self) -> int:
        return sum(count for _, count in self.items() if count > 0)

    @property
    def released_pages(self) -> int:
        return -sum(count for _, count in self.items() if count < 0)


class PageGrants(VirtualRange):
    """The scheduler's view of a KV pool that worker processes map: page state, no memory.

    ``ranks`` workers each map every page, so one page index costs ``ranks`` pages
    (:attr:`bytes_per_page`). :meth:`drain` hands over the operations recorded since the last
    drain; :meth:`granted_pages` is the state the workers reach once they applied every batch
    drained so far. ``held``: pages every worker commits by itself before any batch arrives
    (the null block's, in an engine), counted as granted from the start."""

    backend_name = "grants"

    def __init__(
        self, size_bytes: int, page_size: int, ranks: int = 1, held: Iterable[int] = ()
    ) -> None:
        if ranks < 1:
            raise ValueError(f"a KV pool is mapped by at least one worker, got ranks={ranks}")
        if size_bytes <= 0 or size_bytes % page_size:
            raise ValueError(
                f"size_bytes must be a positive multiple of the page size {page_size}, "
                f"got {size_bytes}"
            )
        super().__init__(base_address=0, size_bytes=size_bytes, page_size=page_size, strict=True)
        self._ranks = ranks
        self._runs: list[int] = []
        self._seq = 0
        self._granted = len(set(held))  # committed pages as of the last drain
        self._ops_lock = threading.Lock()

    @property
    def ranks(self) -> int:
        return self._ranks

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self._ranks

    @property
    def pending(self) -> bool:
        """Whether operations wait for the next :meth:`drain`."""
        return bool(self._runs)

    def drain(self) -> PageOps | None:
        """The operations recorded since the last drain, numbered; None when there are none
        (a step that changed no page sends nothing)."""
        if not self._runs:  # most steps change no page: no lock for them
            return None
        with self._ops_lock:
            if not self._runs:
                return None
            runs, self._runs = tuple(self._runs), []
            self._seq += 1
            self._granted = self.num_committed
            return PageOps(self._seq, runs)

    def granted_pages(self) -> int:
        """Pages every worker holds committed once it applied all batches drained so far."""
        return self._granted

    def footprint_bytes(self) -> int:
        """Bytes the workers hold after applying every drained batch (this process maps
        nothing; each worker's own footprint is its kernel's or driver's count)."""
        return self._granted * self.bytes_per_page

    def as_tensor(self) -> torch.Tensor:
        raise VmmError(
            "page grants have no memory in this process: each worker maps the pages in its own "
            "range and builds the KV tensor there"
        )

    def _commit_run(self, first: int, count: int) -> None:
        with self._ops_lock:
            self._runs += (first, count)

    def _release_run(self, first: int, count: int) -> None:
        with self._ops_lock:
            self._runs += (first, -count)

    def _teardown(self) -> None:
        with self._ops_lock:
            self._runs.clear()


Fence = Callable[[], object]


class GrantFollower:
    """A worker's side: applies the scheduler's :class:`PageOps` to the worker's own range.

    ``mark_step`` returns a token that :func:`done` is later asked about (host: None, always
    done; CUDA: an event recorded after the step's work was queued). A release received with a
    batch waits until the token of the step before it is done, since that step may still read
    the page; :meth:`apply` returns once everything that can be applied is."""

    def __init__(
        self,
        vmm_range: VirtualRange,
        *,
        mark_step: Callable[[], object] | None = None,
        done: Callable[[object], bool] | None = None,
        wait: Callable[[], None] | None = None,
    ) -> None:
        self.range = vmm_range
        self._mark_step = mark_step
        self._done = done
        self._wait = wait
        self._seq = 0
        self._fence: object = None  # the token of the last step this worker ran
        # Pages whose release waits, with the fence they wait for (oldest first).
        self._held: dict[int, object] = {}
        self.batches = 0

    @property
    def seq(self) -> int:
        """The number of the last batch applied (0: none yet)."""
        return self._seq

    @property
    def held_pages(self) -> frozenset[int]:
        """Pages released by the scheduler, still mapped until earlier work is done."""
        return frozenset(self._held)

    def apply(self, ops: PageOps | None) -> None:
        """Apply one batch (None: nothing changed since the last one), then every held
        release whose fence has passed. Raises :class:`GrantOrderError` for a batch out of
        order and the range's own error when a commit fails (nothing of it stays mapped)."""
        if ops is not None:
            if ops.seq != self._seq + 1:
                raise GrantOrderError(
                    f"page operations batch {ops.seq} arrived after batch {self._seq}: a batch "
                    "was lost or repeated between the scheduler and this worker; the engine "
                    "cannot continue safely"
                )
            commit: list[int] = []
            for first, count in ops.items():
                if count > 0:
                    pages = range(first, first + count)
                    for page in pages:
                        if self._held.pop(page, _MISSING) is _MISSING:
                            commit.append(page)
                else:
                    if commit:  # keep the scheduler's order: commits before this release
                        self.range.commit(commit)
                        commit = []
                    for page in range(first, first - count):
                        self._held[page] = self._fence
            if commit:
                self.range.commit(commit)
            self._seq = ops.seq
            self.batches += 1
        self._release_passed()

    def step_queued(self) -> None:
        """The worker queued a step's work: releases received from now on wait for it."""
        if self._mark_step is not None:
            self._fence = self._mark_step()

    def wait(self) -> None:
        """Wait for all queued work (at once where the host ran it synchronously)."""
        if self._wait is not None:
            self._wait()

    def settle(self) -> None:
        """Wait for all queued work, then release every held page (the engine is idle)."""
        if self._held:
            self.wait()
            self._release([*self._held])

    def _release_passed(self) -> None:
        if not self._held:
            return
        done = self._done
        if done is None:
            self._release([*self._held])
            return
        ready = [page for page, fence in self._held.items() if fence is None or done(fence)]
        if ready:
            self._release(ready)

    def _release(self, pages: list[int]) -> None:
        """Release ``pages`` (all held); a page whose release failed stays held (and mapped:
        the range says so), to be released again with the next batch."""
        fences = {page: self._held.pop(page) for page in pages}
        try:
            for first, count in page_runs(sorted(pages)):
                self.range.release(range(first, first + count))
                for page in range(first, first + count):
                    del fences[page]
        finally:
            self._held.update(fences)


_MISSING = object()
