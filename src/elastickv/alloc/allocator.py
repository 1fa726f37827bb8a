"""Blocks inside pages: commit a page when a block on it is first needed, release it when the
last block on it is freed (beyond a bounded hot reserve).

Placement works on slabs (blocks sharing one page set, see :mod:`elastickv.alloc.pagemap`).
A slab is *warm* when all its pages are committed and *cold* otherwise; a slab with a live
block is always warm. A request is served from warm slabs when it can be (best fit: the
fullest slab that holds the whole request, else the largest slabs first), so requests stay on
few pages and nearly empty slabs drain whole; only the remainder goes to cold slabs, those
missing the fewest pages first. Warm slabs sit in buckets by free count with a bitmask of
non-empty buckets, so the common allocation is a handful of O(1) steps.

The slab being filled is *checked out* of the buckets as the cursor: while it holds the
request and has a live block, allocation and free touch nothing but its free list and a few
counters. Every other path checks the cursor back in first, so the buckets are exact there.

Every state change happens under one lock, in three phases for a growing allocation: plan
(read only), admit + commit (the only steps that can fail; rolled back completely), apply.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn, Self

from elastickv.alloc.pagemap import PageMap
from elastickv.alloc.policy import CapacityPolicy, Unlimited
from elastickv.vmm.errors import CommitError, ReleaseError

if TYPE_CHECKING:
    from elastickv.geometry import KVCacheGeometry
    from elastickv.vmm.base import VirtualRange

NULL_BLOCK = 0


class _TokenLock:
    """A non-reentrant mutex whose uncontended acquire and release are one ``list.pop`` and
    one ``list.append`` of a single token (each atomic). ``threading.Lock.acquire`` parses
    its arguments on every call and costs several times more in CPython 3.11, as much as the
    rest of a one-block allocation. A thread that finds the token taken waits on a condition;
    the holder wakes it when it puts the token back.

    Why no wake-up is lost: a waiter counts itself (under the condition's lock) before it
    tries the token, and the holder puts the token back before it reads the count. Either
    the holder sees the waiter and notifies it (under the same lock, so only once the waiter
    waits), or the waiter counted itself after the token was back and takes it."""

    __slots__ = ("_cond", "token", "waiters")

    def __init__(self) -> None:
        self.token: list[None] = [None]
        self.waiters = 0
        self._cond = threading.Condition(threading.Lock())

    def acquire(self) -> None:
        try:
            self.token.pop()
        except IndexError:
            self.wait()

    def wait(self) -> None:
        """Block until this thread holds the token (the contended path of an acquire)."""
        with self._cond:
            self.waiters += 1
            try:
                while True:
                    try:
                        self.token.pop()
                        return
                    except IndexError:
                        self._cond.wait()
            finally:
                self.waiters -= 1

    def release(self) -> None:
        self.token.append(None)
        if self.waiters:
            self.wake()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class AllocatorStats:
    """A consistent snapshot of an allocator's state and counters."""

    num_blocks: int
    usable_blocks: int
    live_blocks: int
    free_blocks: int
    committed_pages: int
    hot_pages: int
    page_size: int
    bytes_per_page: int
    allocations: int
    refusals: int
    frees: int
    pages_committed: int
    pages_released: int
    rollbacks: int
    last_error: str | None
    pages_precommitted: int = 0  # of ``pages_committed``: ahead of demand (:meth:`precommit`)

    @property
    def committed_bytes(self) -> int:
        return self.committed_pages * self.bytes_per_page


def null_floor_bytes(page_map: PageMap, bytes_per_page: int | None = None) -> int:
    """Bytes an allocator with a null block commits before it hands out anything: every page
    of the null block's slab. Known from the geometry alone, so a budget can be checked
    against it (and a refusal explained) before the allocator exists. ``bytes_per_page``
    is what one page index costs (default: one page; several for pages several ranks map)."""
    per_page = page_map.page_size if bytes_per_page is None else bytes_per_page
    return len(page_map.slab_pages[page_map.block_slab[NULL_BLOCK]]) * per_page


def _as_block_id(value: object) -> int | None:
    """``value`` as an integer block id (Python or NumPy integers), or None."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _sorted(values: Collection[object]) -> list[object]:
    """``values`` in order where they can be ordered (for an error message)."""
    try:
        return sorted(values)  # type: ignore[type-var]
    except TypeError:
        return list(values)


class BlockAllocator:
    """Elastic block allocator over one geometry laid out in one virtual range.

    ``allocate(n)`` returns ``n`` block ids or ``None`` ("not now": too few free blocks, the
    policy refused the bytes, or the commit failed — in every case nothing changed).
    ``free`` raises ``ValueError`` for a block that is not live (and then frees nothing).
    """

    def __init__(
        self,
        geometry: KVCacheGeometry,
        vmm_range: VirtualRange,
        policy: CapacityPolicy | None = None,
        *,
        min_hot_pages: int = 0,
        max_hot_pages: int | None = None,
        reserve_null_block: bool = True,
        page_map: PageMap | None = None,
    ) -> None:
        page_size = vmm_range.page_size
        if geometry.backing_bytes > vmm_range.size_bytes:
            raise ValueError(
                f"the geometry needs {geometry.backing_bytes} bytes but the range holds "
                f"{vmm_range.size_bytes}; reserve a larger range"
            )
        if max_hot_pages is None:
            max_hot_pages = max(min_hot_pages, 0)
        if not 0 <= min_hot_pages <= max_hot_pages:
            raise ValueError(
                f"need 0 <= min_hot_pages <= max_hot_pages, got {min_hot_pages}, {max_hot_pages}"
            )
        pmap = page_map if page_map is not None else PageMap(geometry, page_size)
        if pmap.page_size != page_size or pmap.num_blocks != geometry.num_blocks:
            raise ValueError("page_map was built for another geometry or page size")
        self.geometry = geometry
        self.page_map = pmap
        self._range = vmm_range
        self._policy: CapacityPolicy = policy if policy is not None else Unlimited()
        self._page_size = page_size
        # What the policy is charged per page index (page_size × ranks for page grants that
        # several ranks map).
        self._page_bytes = vmm_range.bytes_per_page
        self._min_hot = min_hot_pages
        self._max_hot = max_hot_pages
        # Blocks the scheduler expects to allocate soon, and the hot pages that may be kept
        # for them beyond ``max_hot_pages`` (see :meth:`forecast`).
        self._forecast = 0
        self._forecast_pages = 0
        self._lock = _TokenLock()
        self._closed = False

        num_slabs = pmap.num_slabs
        self._block_slab = pmap.block_slab
        self._slab_pages = pmap.slab_pages
        self._page_slabs = pmap.page_slabs
        self._free: list[list[int]] = [list(reversed(b)) for b in pmap.slab_blocks]
        self._slab_live = [0] * num_slabs
        self._missing = [len(p) for p in pmap.slab_pages]
        self._page_users = [0] * pmap.num_pages
        self._committed = bytearray(pmap.num_pages)
        self._num_committed = 0
        self._touched_pages = sum(1 for slabs in pmap.page_slabs if slabs)
        # Slabs that are runs of consecutive block ids: a set of blocks lies in one slab iff
        # its smallest and largest do.
        self._contiguous_slabs = all(b[-1] - b[0] == len(b) - 1 for b in pmap.slab_blocks)
        # The hot reserve (committed pages under no live block) in two parts. Pages only one
        # slab touches are in use exactly while that slab has a live block, so they are
        # counted per idle slab (slab -> its committed own pages; oldest idle first) and a
        # slab going idle or live is O(1). Pages several slabs share are counted one by one.
        self._own_pages = tuple(
            tuple(p for p in pages if len(pmap.page_slabs[p]) == 1) for pages in pmap.slab_pages
        )
        self._own_slab = [slabs[0] if len(slabs) == 1 else -1 for slabs in pmap.page_slabs]
        self._idle: dict[int, int] = {}
        self._hot_own = 0
        self._hot_shared: set[int] = set()
        self._shared_pages = tuple(
            tuple(p for p in pages if len(pmap.page_slabs[p]) > 1) for pages in pmap.slab_pages
        )
        self._live: set[int] = set()
        self._limit = self._num_blocks = geometry.num_blocks
        widest = max(len(b) for b in pmap.slab_blocks)
        self._warm: list[dict[int, None]] = [{} for _ in range(widest + 1)]
        self._warm_mask = 0
        deepest = max(len(p) for p in pmap.slab_pages)
        self._cold: list[dict[int, None]] = [{} for _ in range(deepest + 1)]
        self._cold_free = 0
        self._warm_free = 0
        self._allocations = self._refusals = self._frees = 0
        self._pages_committed = self._pages_released = self._rollbacks = 0
        self._pages_precommitted = 0
        self._resizes = 0
        # Grows whenever the free or committed blocks may have changed (every allocation,
        # free, page commit or release, resize): a cache key for callers that ask about
        # the same state many times (a scheduler, once per running request per step).
        self.state_version = 0
        # :meth:`blocks_within`'s last question (with the state it was asked in) and answer.
        self._within_key: tuple[int | None, ...] = ()
        self._within = 0
        self._last_error: str | None = None
        # Called with the seconds each page commit took (admission + backend), e.g. by a
        # metrics histogram; None costs nothing.
        self.commit_observer: Callable[[float], None] | None = None
        self._null = NULL_BLOCK if reserve_null_block else None
        # The slab being filled, out of the buckets (-1: none). It is always warm and live, so
        # no page of it is hot and no commit or release touches it.
        self._cursor = -1

        if self._null is not None:
            self._free[self._block_slab[self._null]].remove(self._null)
        for slab in range(num_slabs):
            self._link(slab)
        if self._null is not None:
            slab = self._block_slab[self._null]
            if not self._commit_pages(set(self._slab_pages[slab])):
                raise CommitError(
                    "cannot commit the null block's pages: "
                    f"{self._last_error or 'the capacity policy refused them'}"
                )
            self._first_live(slab)
            self._slab_live[slab] = 1
        if min_hot_pages:
            self.precommit()

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Free usable blocks (index capacity; physical capacity is the policy's). O(1)."""
        return self._warm_free + self._cold_free

    @property
    def warm_free_blocks(self) -> int:
        """Free usable blocks on committed pages (allocating them commits nothing). O(1)."""
        return self._warm_free

    @property
    def num_committed_pages(self) -> int:
        """Pages committed now (in use and hot). O(1)."""
        return self._num_committed

    @property
    def num_usable_blocks(self) -> int:
        return self._limit

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def bytes_per_page(self) -> int:
        """What one committed page index costs the policy (see ``VirtualRange.bytes_per_page``)."""
        return self._page_bytes

    @property
    def policy(self) -> CapacityPolicy:
        return self._policy

    @property
    def vmm_range(self) -> VirtualRange:
        return self._range

    @property
    def min_hot_pages(self) -> int:
        return self._min_hot

    @property
    def max_hot_pages(self) -> int:
        return self._max_hot

    def can_allocate(self, n: int) -> bool:
        """O(1) answer to "would ``allocate(n)`` succeed now?".

        Exact when the request fits in committed pages; otherwise it assumes the remainder
        needs whole typical slabs (capped by the pages not yet committed), which is exact for
        the usual layouts (disjoint, equal-sized slabs) and for a request of every free block,
        and conservative in between for layouts whose blocks straddle pages.
        """
        if n <= self._warm_free:
            return True
        if n > self._warm_free + self._cold_free:
            return False
        pmap = self.page_map
        slabs = -(-(n - self._warm_free) // pmap.typical_slab_blocks)
        pages = min(slabs * pmap.typical_slab_pages, self._touched_pages - self._num_committed)
        return self._policy.available_bytes() >= pages * self._page_bytes

    def blocks_within(self, nbytes: int, cap: int | None = None) -> int:
        """How many blocks :meth:`allocate` can hand out now while admitting at most
        ``nbytes`` of new pages: ``allocate(k)`` succeeds for every ``k`` up to the answer
        (when the policy admits ``nbytes``), and the answer is exact for the usual layouts.
        ``cap``: stop counting there (the caller needs no more).

        Why it holds: ``allocate`` takes warm blocks first, then cold slabs in the order
        walked here (fewest uncommitted pages first) and commits the pages of each slab it
        touches; this counts whole slabs in that order while their pages fit ``nbytes``
        (pages two slabs share are counted twice: conservative)."""
        # The same question about the same state has the same answer (a scheduler asks it for
        # every running request in every step, most of which change nothing).
        key = (nbytes, cap, self.state_version)
        if key == self._within_key:
            return self._within
        with self._lock:
            self._within = answer = self._count_within(nbytes, cap)
            self._within_key = key
            return answer

    def _count_within(self, nbytes: int, cap: int | None) -> int:
        warm = self._warm_free  # the slab being filled is warm: counted here
        cap = self._warm_free + self._cold_free if cap is None else cap
        if warm >= cap or not self._cold_free:
            return min(warm, cap)
        pages = nbytes // self._page_bytes
        if pages >= self._touched_pages - self._num_committed:
            return min(warm + self._cold_free, cap)  # every page a block touches fits
        total = warm
        free = self._free
        for missing, bucket in enumerate(self._cold):
            if not missing or not bucket:
                continue
            for slab in bucket:
                if missing > pages:
                    return min(total, cap)
                pages -= missing
                total += len(free[slab])
                if total >= cap:
                    return cap
        return min(total, cap)

    def is_live(self, block: int) -> bool:
        return block in self._live

    def live_blocks(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._live)

    def committed_pages(self) -> frozenset[int]:
        """Pages this allocator holds committed (its own view; the range's must agree)."""
        with self._lock:
            return frozenset(i for i, c in enumerate(self._committed) if c)

    def hot_pages(self) -> frozenset[int]:
        with self._lock:
            own = self._own_pages
            committed = self._committed
            idle = (p for slab in self._idle for p in own[slab] if committed[p])
            return frozenset(self._hot_shared.union(idle))

    def floor_bytes(self) -> int:
        """What the allocator holds for its whole life: the pages of the null block's slab
        (committed at construction, released only by :meth:`close`); 0 without a null block."""
        if self._null is None:
            return 0
        return null_floor_bytes(self.page_map, self._page_bytes)

    def null_block_pages(self) -> frozenset[int]:
        if self._null is None:
            return frozenset()
        return frozenset(self.page_map.pages_of_block(self._null))

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(
                num_blocks=self.page_map.num_blocks,
                usable_blocks=self._limit,
                live_blocks=len(self._live),
                free_blocks=self._warm_free + self._cold_free,
                committed_pages=sum(self._committed),
                hot_pages=self._num_hot,
                page_size=self._page_size,
                bytes_per_page=self._page_bytes,
                allocations=self._allocations,
                refusals=self._refusals,
                frees=self._frees,
                pages_committed=self._pages_committed,
                pages_released=self._pages_released,
                rollbacks=self._rollbacks,
                last_error=self._last_error,
                pages_precommitted=self._pages_precommitted,
            )

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free blocks, all backed by committed pages, or ``None`` if not possible now."""
        lock = self._lock
        token = lock.token
        try:
            token.pop()  # :meth:`_TokenLock.acquire`, inlined
        except IndexError:
            lock.wait()
        try:
            cursor = self._cursor
            if cursor >= 0:
                free = self._free[cursor]
                if n == 1 and free:  # a decode step's block: no slicing
                    block = free.pop()
                    self._warm_free -= 1
                    self._slab_live[cursor] += 1
                    self._live.add(block)
                    self._allocations += 1
                    self.state_version += 1
                    return [block]
                if 0 < n <= len(free):
                    blocks = free[-n:]
                    del free[-n:]
                    self._warm_free -= n
                    self._slab_live[cursor] += n
                    self._live.update(blocks)
                    self._allocations += 1
                    self.state_version += 1
                    return blocks
                self._check_in()
            if 0 < n <= self._warm_free:
                mask = self._warm_mask
                wider = mask >> n
                if not wider:
                    blocks = self._take_warm(n)
                else:
                    # Fast path: the fullest warm slab that holds the whole request.
                    size = n + (wider & -wider).bit_length() - 1
                    bucket = self._warm[size]
                    slab = bucket.popitem()[0]
                    if not bucket:
                        mask ^= 1 << size
                    free = self._free[slab]
                    blocks = free[-n:]
                    del free[-n:]
                    self._warm_mask = mask
                    self._warm_free -= n
                    live = self._slab_live
                    if not live[slab]:
                        self._first_live(slab)
                    live[slab] += n
                    self._live.update(blocks)
                    if size != n:
                        self._cursor = slab  # stays out of the buckets while it fills
            else:
                grown = self._allocate_slow(n)
                if grown is None:
                    return None
                blocks = grown
            self._allocations += 1
            self.state_version += 1
            return blocks
        finally:
            token.append(None)  # :meth:`_TokenLock.release`, inlined
            if lock.waiters:
                lock.wake()

    def _check_in(self) -> None:
        """Return the cursor slab to the buckets (before any path that reads them)."""
        slab = self._cursor
        if slab >= 0:
            self._cursor = -1
            free = len(self._free[slab])
            self._warm_free -= free  # :meth:`_link` adds it back
            self._link(slab)

    def _allocate_slow(self, n: int) -> list[int] | None:
        if n <= 0:
            if n < 0:
                raise ValueError(f"cannot allocate {n} blocks")
            return []
        if self._closed:
            raise RuntimeError("the allocator is closed")
        if n > self._warm_free + self._cold_free:
            self._refusals += 1
            return None
        blocks = self._allocate_cold(n)
        if blocks is None:
            self._refusals += 1
        return blocks

    def _take_warm(self, n: int) -> list[int]:
        """Take ``n <= warm_free`` blocks from warm slabs: best fit, else largest first."""
        out: list[int] = []
        remaining = n
        while remaining:
            mask = self._warm_mask
            wider = mask >> remaining
            fit = remaining + (wider & -wider).bit_length() - 1
            size = fit if wider else mask.bit_length() - 1
            slab = next(reversed(self._warm[size]))
            out.extend(self._take(slab, min(size, remaining)))
            remaining -= min(size, remaining)
        return out

    def _allocate_cold(self, n: int) -> list[int] | None:
        """Serve ``n > warm_free`` blocks. Either every warm block plus cold slabs for the
        rest, or, when that commits no fewer pages, cold slabs alone (the request then sits
        on fewer slabs and the warm scraps stay for smaller requests)."""
        plan, pages = self._plan_cold(n - self._warm_free)
        if self._warm_free and n <= self._cold_free:
            alone, alone_pages = self._plan_cold(n)
            if len(alone_pages) <= len(pages):
                plan, pages = alone, alone_pages
        if not self._commit_pages(pages):
            return None
        out: list[int] = []
        for slab, take in plan:
            out.extend(self._take(slab, take))
        rest = n - len(out)
        if rest:
            out.extend(self._take_warm(rest))
        return out

    def _plan_cold(self, need: int) -> tuple[list[tuple[int, int]], set[int]]:
        """Cold slabs (fewest missing pages first) holding ``need`` blocks, and the pages to
        commit for them. Read only."""
        plan: list[tuple[int, int]] = []
        pages: set[int] = set()
        committed = self._committed
        for bucket in self._cold[1:]:
            for slab in bucket:
                take = min(len(self._free[slab]), need)
                plan.append((slab, take))
                pages.update(p for p in self._slab_pages[slab] if not committed[p])
                need -= take
                if not need:
                    return plan, pages
        raise AssertionError("free-block counters disagree with the slabs")

    def _take(self, slab: int, k: int) -> list[int]:
        self._unlink(slab)
        blocks = self._free[slab]
        taken = blocks[-k:]
        del blocks[-k:]
        if not self._slab_live[slab]:
            self._first_live(slab)
        self._slab_live[slab] += k
        self._live.update(taken)
        self._link(slab)
        return taken

    @property
    def _num_hot(self) -> int:
        return self._hot_own + len(self._hot_shared)

    def _first_live(self, slab: int) -> None:
        """``slab`` (warm: every page committed) gets its first live block."""
        self._hot_own -= self._idle.pop(slab, 0)
        users = self._page_users
        for page in self._shared_pages[slab]:
            users[page] += 1
            if users[page] == 1:
                self._hot_shared.remove(page)

    # -- free ---------------------------------------------------------------------------------

    def free(self, blocks: Collection[int]) -> None:
        """Return live blocks; pages whose last block left join the hot reserve (up to its max)
        and are released beyond it. Raises ``ValueError`` (freeing nothing) if any block is
        not live or repeats."""
        lock = self._lock
        token = lock.token
        try:
            token.pop()
        except IndexError:
            lock.wait()
        try:
            live = self._live
            run: Collection[int] = blocks
            if len(blocks) == 1:
                (top,) = blocks
                try:
                    live.remove(top)
                except KeyError:
                    raise ValueError(f"cannot free block {top}: it is not live") from None
                slab = self._block_slab[top]
                slab_live = self._slab_live
                if slab == self._cursor and top < self._limit and slab_live[slab] > 1:
                    # Fastest path: one block back to the slab being filled, which stays live.
                    self._free[slab].append(top)
                    self._warm_free += 1
                    slab_live[slab] -= 1
                    self._frees += 1
                    self.state_version += 1
                    return
            elif not blocks:
                return
            else:
                slab_of = self._block_slab
                if self._limit != self._num_blocks and not live.issuperset(blocks):
                    bad = sorted(set(blocks) - live)
                    raise ValueError(f"cannot free blocks that are not live: {bad}")
                before = len(live)
                live.difference_update(blocks)  # liveness checked by the count, at no cost
                if before - len(live) != len(blocks):
                    self._refuse_free(blocks)
                if isinstance(blocks, list) and slab_of[blocks[0]] != slab_of[blocks[-1]]:
                    # Several slabs for sure (a request's prompt and decode blocks, freed in
                    # reverse): skip the one-slab test.
                    self._free_slabs(blocks)
                    self._frees += 1
                    self.state_version += 1
                    return
                # The smallest and largest block (sorting a few ints costs half of min + max).
                ordered = sorted(blocks)
                top = ordered[-1]
                slab = slab_of[top]
                if not (self._contiguous_slabs and slab == slab_of[ordered[0]]):
                    self._free_slabs(blocks)
                    self._frees += 1
                    self.state_version += 1
                    return
            if slab == self._cursor:
                free = self._free[slab]
                before = len(free)
                if top < self._limit:
                    free.extend(run)
                else:
                    free.extend(b for b in run if b < self._limit)
                self._warm_free += len(free) - before
                slab_live = self._slab_live
                slab_live[slab] -= len(run)
                if slab_live[slab]:
                    self._frees += 1
                    self.state_version += 1
                    return  # no page changed hands: the reserve is as it was
                self._check_in()
                self._last_live_gone(slab)
                self._frees += 1
                self.state_version += 1
                self._cap_reserve()
                return
            # One slab (the common case).
            free = self._free[slab]
            before = len(free)
            if top < self._limit:
                free.extend(run)
            else:
                free.extend(b for b in run if b < self._limit)
            after = len(free)
            if after != before:
                warm = self._warm
                mask = self._warm_mask
                if before:
                    bucket = warm[before]
                    del bucket[slab]
                    if not bucket:
                        mask ^= 1 << before
                warm[after][slab] = None
                self._warm_mask = mask | 1 << after
                self._warm_free += after - before
            slab_live = self._slab_live
            slab_live[slab] -= len(run)
            self._frees += 1
            self.state_version += 1
            if not slab_live[slab]:
                self._last_live_gone(slab)
                self._cap_reserve()
        finally:
            token.append(None)
            if lock.waiters:
                lock.wake()

    def _refuse_free(self, blocks: Collection[int]) -> NoReturn:
        """``free`` removed fewer blocks from ``_live`` than it was given: put back the ones
        that were live and raise. Which were is read from the other books, which the failed
        free did not touch: with every block usable (``free`` checks liveness up front
        otherwise), a valid block is exactly one of live, on its slab's free list, or the
        null block. Only this error path pays for that; the common path tests liveness by
        the count ``difference_update`` removed."""
        unique = set(blocks)
        was_live = {b for b in map(_as_block_id, unique) if b is not None and self._held(b)}
        self._live.update(was_live)
        bad = unique - was_live
        if bad:
            raise ValueError(f"cannot free blocks that are not live: {_sorted(bad)}")
        raise ValueError(f"cannot free repeated blocks: {sorted(blocks)}")

    def _held(self, block: int) -> bool:
        """Whether a valid block id is neither free nor the null block (see
        :meth:`_refuse_free`)."""
        return (
            0 <= block < self._num_blocks
            and block != self._null
            and block not in self._free[self._block_slab[block]]
        )

    def _free_slabs(self, blocks: Collection[int]) -> None:
        """Put back live blocks (already removed from ``_live``) that lie in several slabs,
        e.g. a request's prompt and decode blocks, in the order vLLM frees them (reversed).

        Blocks come back in the slab runs they were handed out in; the runs of one slab are
        merged, and each slab moves between buckets once. The cursor slab stays checked out
        while it keeps a live block, as on the single-slab paths."""
        slab_of = self._block_slab
        groups: dict[int, list[int]] = {}
        group: list[int] = []
        prev = -1
        for block in blocks:  # a plain loop: cheaper than groupby for runs this short
            slab = slab_of[block]
            if slab != prev:
                prev = slab
                found = groups.get(slab)
                if found is None:
                    found = groups[slab] = []
                group = found
            group.append(block)
        cursor = self._cursor
        limit = self._limit
        shrunk = limit < self._num_blocks
        free_lists = self._free
        slab_live = self._slab_live
        warm = self._warm
        went_idle = False
        for slab, group in groups.items():
            free = free_lists[slab]
            before = len(free)
            if shrunk:
                free.extend(b for b in group if b < limit)
            else:
                free.extend(group)
            after = len(free)
            live = slab_live[slab] - len(group)
            slab_live[slab] = live
            if slab == cursor:
                # Its free blocks are counted in ``_warm_free`` while it is checked out.
                self._warm_free += after - before
                if not live:
                    self._check_in()
                    self._last_live_gone(slab)
                    went_idle = True
                continue
            if after != before:
                if before:
                    bucket = warm[before]
                    del bucket[slab]
                    if not bucket:
                        self._warm_mask ^= 1 << before
                warm[after][slab] = None
                self._warm_mask |= 1 << after
                self._warm_free += after - before
            if not live:
                self._last_live_gone(slab)
                went_idle = True
        if went_idle:
            self._cap_reserve()

    def _cap_reserve(self) -> None:
        """After pages joined the reserve: release what is beyond its maximum (raised while a
        forecast wants more). Freeing only ever grows the reserve, so only the maximum needs
        checking. A failed release leaves its pages hot and is recorded in ``last_error``;
        the blocks are freed either way, so the caller is not interrupted."""
        cap = self.hot_reserve_cap
        if self._hot_own + len(self._hot_shared) > cap:
            with contextlib.suppress(ReleaseError):
                self._shrink_hot(cap)

    def _last_live_gone(self, slab: int) -> None:
        """``slab`` lost its last live block: its (all committed) pages join the reserve."""
        own = len(self._own_pages[slab])
        if own:
            self._idle[slab] = own
            self._hot_own += own
        users = self._page_users
        for page in self._shared_pages[slab]:
            users[page] -= 1
            if not users[page]:
                self._hot_shared.add(page)

    # -- capacity management ------------------------------------------------------------------

    def resize(self, num_usable_blocks: int) -> None:
        """Make blocks ``[0, num_usable_blocks)`` allocatable. Shrinking is lazy: live blocks
        above the limit stay valid and simply do not come back when freed."""
        if not 1 <= num_usable_blocks <= self.page_map.num_blocks:
            raise ValueError(
                f"num_usable_blocks must be in [1, {self.page_map.num_blocks}], "
                f"got {num_usable_blocks}"
            )
        with self._lock:
            self._check_in()
            self._resizes += 1
            self.state_version += 1
            old = self._limit
            self._limit = num_usable_blocks
            if num_usable_blocks < old:
                for slab in sorted({self._block_slab[b] for b in range(num_usable_blocks, old)}):
                    self._unlink(slab)
                    self._free[slab] = [b for b in self._free[slab] if b < num_usable_blocks]
                    self._link(slab)
            else:
                added: dict[int, list[int]] = {}
                for block in range(old, num_usable_blocks):
                    if block not in self._live and block != self._null:
                        added.setdefault(self._block_slab[block], []).append(block)
                for slab, items in added.items():
                    self._unlink(slab)
                    self._free[slab].extend(reversed(items))
                    self._link(slab)

    def set_hot_reserve(self, min_hot_pages: int, max_hot_pages: int) -> None:
        if not 0 <= min_hot_pages <= max_hot_pages:
            raise ValueError("need 0 <= min_hot_pages <= max_hot_pages")
        with self._lock:
            self._check_in()
            self._min_hot, self._max_hot = min_hot_pages, max_hot_pages
            if self._num_hot > max_hot_pages:
                self._shrink_hot(max_hot_pages)

    def trim(self, keep_pages: int = 0) -> int:
        """Release hot-reserve pages down to ``keep_pages``; returns how many were released."""
        with self._lock:
            self._check_in()
            return self._shrink_hot(keep_pages)

    def forecast(self, blocks: int) -> None:
        """The scheduler expects to allocate about ``blocks`` blocks soon (its waiting
        prompts, its running requests' next blocks). Until it drops, freed pages stay hot up
        to the pages ``blocks`` blocks take (``hot_reserve_cap``), even beyond
        ``max_hot_pages``: an engine at its limit with requests waiting would otherwise
        release the pages a finished request frees and commit them again a step later. Hot
        pages beyond the cap go back at once when the forecast drops. Once per scheduler
        step: no lock unless pages go back, and an unchanged forecast returns at once (every
        free already keeps the reserve at the cap this forecast set)."""
        if blocks == self._forecast:
            return
        if blocks < 0:
            raise ValueError(f"a forecast is a number of blocks >= 0, got {blocks}")
        self._forecast = blocks
        # Pages ``blocks`` blocks take at this geometry's density (rounded up).
        self._forecast_pages = -(-blocks * self._touched_pages // self._num_blocks)
        if self._num_hot > self.hot_reserve_cap:  # the demand dropped: keep no more
            with self._lock:
                self._check_in()
                self._cap_reserve()

    @property
    def forecast_blocks(self) -> int:
        """The latest :meth:`forecast` (0 before any)."""
        return self._forecast

    @property
    def hot_reserve_cap(self) -> int:
        """Hot pages kept at most now: ``max_hot_pages``, raised to the pages of the latest
        :meth:`forecast` while that is larger."""
        return max(self._max_hot, self._forecast_pages)

    def precommit(self) -> int:
        """Commit whole cold slabs until the hot reserve reaches ``min_hot_pages`` and the free
        blocks on committed pages cover the forecast (never past ``max_hot_pages`` or the
        pages of the forecast, whichever is larger), then release hot pages beyond that
        (a forecast that dropped); returns the pages committed."""
        cap = self.hot_reserve_cap
        if (
            self._min_hot <= self._num_hot <= cap and self._warm_free >= self._forecast
        ):  # nothing to do (read without the lock: the scheduler's path stays uncontended)
            return 0
        done = 0
        with self._lock:
            self._check_in()
            cap = self.hot_reserve_cap
            while not self._closed and (
                self._num_hot < self._min_hot or self._warm_free < self._forecast
            ):
                slab = self._next_cold_slab()
                if slab is None:
                    break
                pages = {p for p in self._slab_pages[slab] if not self._committed[p]}
                if self._num_hot + len(pages) > cap:
                    break
                if not self._commit_pages(pages):
                    break
                done += len(pages)
            self._pages_precommitted += done
            if not self._closed and self._num_hot > cap:
                with contextlib.suppress(ReleaseError):
                    self._shrink_hot(cap)
        return done

    def _next_cold_slab(self) -> int | None:
        for bucket in self._cold[1:]:
            for slab in bucket:
                return slab
        return None

    # -- page commit / release ----------------------------------------------------------------

    def _commit_pages(self, pages: set[int]) -> bool:
        """Admit and commit ``pages`` (all uncommitted); on any failure nothing changes.
        New pages start hot (no live block yet)."""
        if not pages:
            return True
        nbytes = len(pages) * self._page_bytes
        observer = self.commit_observer
        start = time.perf_counter() if observer is not None else 0.0
        if not self._policy.try_admit(nbytes):
            return False
        try:
            self._range.commit(sorted(pages))
        except BaseException as exc:
            self._roll_back_commit(pages, nbytes, exc)
            if isinstance(exc, CommitError):
                return False
            raise
        self._pages_committed += len(pages)
        self.state_version += 1
        self._mark(pages, committed=True)
        if observer is not None:
            observer(time.perf_counter() - start)
        return True

    def _roll_back_commit(self, pages: set[int], nbytes: int, cause: BaseException) -> None:
        """Undo a failed commit: release any page the range still reports committed (a
        backend should leave none), then return the admitted bytes."""
        self._rollbacks += 1
        self._last_error = str(cause)
        stray = sorted(p for p in pages if self._range.is_committed(p))
        if stray:
            try:
                self._range.release(stray)
            except ReleaseError as exc:
                cause.add_note(f"rollback could not release pages {stray}: {exc}")
                kept = {p for p in stray if self._range.is_committed(p)}
                self._pages_committed += len(kept)
                self.state_version += 1
                self._mark(kept, committed=True)
                nbytes -= len(kept) * self._page_bytes
        self._policy.release(nbytes)

    def _shrink_hot(self, keep: int) -> int:
        excess = self._num_hot - max(keep, 0)
        if excess <= 0:
            return 0
        # Drain the longest-idle slabs whole first, then shared pages.
        pages: list[int] = []
        committed = self._committed
        for slab in self._idle:
            if len(pages) >= excess:
                break
            pages.extend(p for p in self._own_pages[slab] if committed[p])
        del pages[excess:]
        if len(pages) < excess:
            pages.extend(sorted(self._hot_shared)[: excess - len(pages)])
        try:
            self._range.release(sorted(pages))
        except ReleaseError as exc:
            self._last_error = str(exc)
            still = {p for p in pages if self._range.is_committed(p)}
            self._after_release(set(pages) - still)
            raise
        self._after_release(set(pages))
        return len(pages)

    def _after_release(self, pages: set[int]) -> None:
        if not pages:
            return
        self._policy.release(len(pages) * self._page_bytes)
        self._pages_released += len(pages)
        self.state_version += 1
        self._mark(pages, committed=False)

    def _mark(self, pages: set[int], *, committed: bool) -> None:
        self._num_committed += len(pages) if committed else -len(pages)
        touched: dict[int, int] = {}
        # Pages committed or released here are under no live block: they enter or leave the
        # hot reserve.
        idle = self._idle
        for page in pages:
            self._committed[page] = committed
            owner = self._own_slab[page]
            if owner >= 0:
                count = idle.get(owner, 0) + (1 if committed else -1)
                if count:
                    idle[owner] = count
                else:
                    del idle[owner]
                self._hot_own += 1 if committed else -1
            elif committed:
                self._hot_shared.add(page)
            else:
                self._hot_shared.discard(page)
            for slab in self._page_slabs[page]:
                touched[slab] = touched.get(slab, 0) + 1
        for slab, count in touched.items():
            self._unlink(slab)
            self._missing[slab] += -count if committed else count
            self._link(slab)

    # -- slab buckets -------------------------------------------------------------------------

    def _link(self, slab: int) -> None:
        free = len(self._free[slab])
        if not free:
            return
        missing = self._missing[slab]
        if missing:
            self._cold[missing][slab] = None
            self._cold_free += free
        else:
            self._warm[free][slab] = None
            self._warm_mask |= 1 << free
            self._warm_free += free

    def _unlink(self, slab: int) -> None:
        free = len(self._free[slab])
        if not free:
            return
        missing = self._missing[slab]
        if missing:
            del self._cold[missing][slab]
            self._cold_free -= free
        else:
            bucket = self._warm[free]
            del bucket[slab]
            if not bucket:
                self._warm_mask &= ~(1 << free)
            self._warm_free -= free

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Release every page this allocator committed (live blocks included: the caller is
        done with the cache). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._check_in()
            self._closed = True
            pages = {i for i, c in enumerate(self._committed) if c}
            if pages and not self._range.closed:
                self._range.release(sorted(pages))
            if pages:
                self._policy.release(len(pages) * self._page_bytes)
            for page in pages:
                self._committed[page] = 0
            self._num_committed = 0
            self._idle.clear()
            self._hot_own = 0
            self._hot_shared.clear()
            self._live.clear()
            for slab in range(self.page_map.num_slabs):
                self._unlink(slab)
                self._free[slab].clear()
            self._warm_mask = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
