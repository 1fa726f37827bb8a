"""vLLM's scheduler block pool, made elastic: it only hands out blocks on committed pages.

Why this shape: vLLM decides whether a request fits with ``get_num_free_blocks()`` and then
allocates unconditionally, so every step that can fail (admission through the capacity
policy, page commits) must happen *before* that answer. The scheduler hooks tell the pool how
many blocks the pending ``allocate_slots`` needs (:meth:`ElasticBlockPool.expect`); the pool
then backs exactly that many blocks (its *stash*) and answers "free" only if it could, so a
refusal becomes vLLM's own "cannot schedule now" (``allocate_slots`` returns ``None``).

Block states, in vLLM terms → elastickv's :class:`BlockAllocator`:

* ``ref_cnt > 0`` (in use), the null block, the stash → live in the allocator;
* ``ref_cnt == 0`` with a prefix-cache hash or still readable after ``unpin`` (*parked*)
  → live (its bytes are still wanted), evicted LRU when capacity is short;
* ``ref_cnt == 0`` otherwise → free in the allocator, so its page can be released.

vLLM keeps its free queue (counts, LRU order, ``touch``); we only choose *which* free blocks
``get_new_blocks`` returns, by moving them to the queue's front first.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import RequestStatus

from elastickv.alloc import AllocatorStats, BlockAllocator
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.registration import registration_of
from elastickv.integrations.vllm.startup import RefusalLog, log_startup, startup_refusal
from elastickv.integrations.vllm.store import REGISTRY, ElasticStore
from elastickv.units import format_bytes
from elastickv.vmm.errors import CommitError

logger = logging.getLogger(__name__)
# How often a scheduler step reads the ledger for a lowered limit. A ledger read takes its
# lock and checks the liveness of every instance, far too much for every step of a small
# model; an operator's limit still lands within this interval.
LIMIT_CHECK_INTERVAL_S = 0.05
# How long a refusal by the limit stands while this engine's room does not grow (see
# :meth:`ElasticBlockPool._known_refusal`): a raised limit, or memory another engine
# released, is seen at most this late.
REFUSAL_RECHECK_S = 0.02
_NO_HITS: frozenset[int] = frozenset()
_RUNNING = RequestStatus.RUNNING


class ElasticCapacityError(RuntimeError):
    """Blocks were requested outside vLLM's admission check and cannot be backed now."""


class ElasticBlockPool(BlockPool):  # type: ignore[misc]
    """A :class:`BlockPool` whose blocks are placed and backed by elastickv."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        store = REGISTRY.require()
        if store.geometry.num_blocks != self.num_gpu_blocks:
            raise ElasticKVStartupError(
                f"the scheduler has {self.num_gpu_blocks} blocks but the elastic KV storage "
                f"was laid out for {store.geometry.num_blocks}"
            )
        if self.null_block.block_id != 0:
            raise ElasticKVStartupError("vLLM's null block is not block 0")
        self.elastic_store: ElasticStore = store
        self._block_tokens = store.geometry.block_size
        self.registration = registration_of(store.policy)
        try:
            self.allocator: BlockAllocator = store.make_allocator()
        except CommitError as exc:
            why = startup_refusal(store, self.registration)
            if self.registration is not None:
                self.registration.close()
            raise ElasticKVStartupError(why) from exc
        self._parked: dict[int, None] = {}  # LRU first
        self._stash: list[int] = []
        self._need: int | None = None
        self._hits: frozenset[int] = _NO_HITS  # prefix hits the open window will touch
        self._in_window = False
        self._headroom = 0
        # The waiting request being admitted in the open window and its manager, whose
        # headroom is counted only when the answer depends on it (see :meth:`open_admission`).
        self._admitting: Any = None
        self._admitting_manager: Any = None
        self._next_limit_check = 0.0
        # Block ids freed while a batch is open (see :meth:`begin_free_batch`); None: none open.
        self._free_batch: list[int] | None = None
        self._refusals = RefusalLog(self.registration.name if self.registration else "engine")
        self._draining_revision = 0
        self.tracked_requests: dict[str, Any] | None = None  # see :meth:`track_requests`
        # The last refusal by the limit: blocks asked, until when it stands, and the capacity
        # it was made at (see :meth:`_known_refusal`).
        self._refused_blocks = 0
        self._refused_until = 0.0
        self._refused_state = (-1, -1, -1, 1)
        # The admission that refusal was for (None: a running request's growth), the headroom
        # counted for it, and the state it was counted in.
        self._refused_request: Any = None
        self._refused_headroom = 0
        self._headroom_state = self._refused_state
        if self.registration is not None:
            self.registration.attach_allocator(self.allocator, cached_blocks=self.cached_blocks)
        log_startup(store, self.allocator, self.registration)

    # -- admission (scheduler hooks) ---------------------------------------------------------

    def open_window(self, headroom: int = 0) -> None:
        """One ``allocate_slots`` call starts: blocks get backed for it (see :meth:`expect`).

        ``headroom`` (for the admission of a waiting request): blocks that must still fit
        under the limit once this request's are backed, so the requests already running can
        take their next blocks. Without it an engine whose limit holds exactly N prompts
        admits N, none of them can grow, and vLLM preempts and re-admits them in turn
        (measured: 44 preemptions and 20 s TTFT in a burst). vLLM's own ``watermark`` cannot
        do this: it is a fraction of the *virtual* block count. It is capped at vLLM's own
        free blocks after the admission, so it binds only where the limit is shorter than
        those (see :meth:`get_num_free_blocks`)."""
        self._in_window = True
        self._headroom = headroom

    def open_admission(self, manager: Any, request: Any) -> None:
        """:meth:`open_window` for admitting the waiting ``request``, its headroom
        (:func:`admission_headroom` with ``manager``) counted only if the answer depends on
        it. An engine at its limit is refused the head of its queue on every step, and
        counting the headroom is a pass over every request holding blocks: while the last
        refusal of that same request stands, it is refused again without one."""
        self._in_window = True
        self._headroom = -1  # not counted yet
        self._admitting = request
        self._admitting_manager = manager

    def close_window(self) -> None:
        """The call ended: blocks backed for it and not used go back."""
        self._in_window = False
        self._headroom = 0
        self._need = None
        if self._admitting is not None:
            self._admitting = self._admitting_manager = None
        if self._hits:
            self._hits = _NO_HITS
        if self._stash:
            self._trim_stash(0)

    def expect(self, num_blocks: int, hits: Iterable[Iterable[Any]] = ()) -> None:
        """The next ``get_num_free_blocks`` decides whether ``num_blocks`` fit now.

        ``hits`` (per KV-cache group) are the prefix-cache blocks this allocation will
        ``touch``: parked ones among them must not be evicted to make room, or vLLM would
        take them back while the allocator hands them out again."""
        if self._in_window:
            self._need = num_blocks
            groups = hits if isinstance(hits, (tuple, list)) else tuple(hits)
            if any(groups):  # usually one empty list per group: nothing to build
                self._hits = frozenset(
                    block.block_id for group in groups for block in group if block.ref_cnt == 0
                )
            elif self._hits:
                self._hits = _NO_HITS

    def get_num_free_blocks(self) -> int:
        free: int = self.free_block_queue.num_free_blocks  # vLLM's own answer, inlined
        need = self._need
        self._need = None
        if not need or need > free:
            # Not ours to decide, or nothing to back: most calls, as vLLM asks for every
            # running request in every step. (A headroom cannot refuse 0 blocks: vLLM's
            # test is ``need > free``.)
            return free
        short = max(0, need - len(self._stash))
        headroom = self._headroom
        if headroom < 0:  # an admission (see :meth:`open_admission`)
            request = self._admitting
            if request is self._refused_request and self._known_refusal(
                short + self._refused_headroom, exact=self._headroom_state
            ):
                # The same request refused again, and no block changed hands since its
                # headroom was counted: the headroom is the same, and it would be refused.
                self._refusals.refused(need + self._refused_headroom, self._committed_bytes)
                return 0
            headroom = self._headroom = admission_headroom(self._admitting_manager, request)
        # The headroom never asks for more than vLLM's own free blocks could give after this
        # admission: where those are what is short (the limit is not), admission is native
        # vLLM's, which admits what fits now and preempts later. It is checked before any
        # block is backed: an engine at its limit refuses the head of its queue on every
        # step, and backing blocks only to hand them back would commit and release pages.
        headroom = max(0, min(headroom, free - need))
        wanted = short + headroom
        if self._known_refusal(wanted):
            self._refusals.refused(need + headroom, self._committed_bytes)
            if self._admitting is not None:  # its next try needs no count either
                self._refused_request, self._refused_headroom = self._admitting, headroom
                self._headroom_state = self._state()
            return 0 if headroom else len(self._stash)
        if headroom and not self._room_for(wanted):
            self._refused(wanted, need + headroom, headroom)
            return 0  # admitting it would leave the running requests no room to grow
        if self._back(need):
            return free
        self._refused(wanted, need, headroom)
        return len(self._stash)  # < need: vLLM answers "cannot schedule now"

    def _state(self) -> tuple[int, int, int, int]:
        """What a refusal by the limit depends on here, each entry only ever smaller while
        this engine's room shrinks: warm free blocks, free blocks, parked blocks (room an
        eviction would make) and committed pages, negated (fewer: usage released)."""
        allocator = self.allocator
        return (
            allocator.warm_free_blocks,
            allocator.num_free_blocks,
            len(self._parked),
            -allocator.num_committed_pages,
        )

    def _refused(self, blocks: int, asked: int, headroom: int) -> None:
        """The limit refused ``blocks`` more (``asked`` in all, for the log; ``headroom`` of
        them for the admission being refused): the refusal stands (see
        :meth:`_known_refusal`)."""
        self._refusals.refused(asked, self._committed_bytes)
        self._refused_blocks = blocks
        self._refused_until = time.monotonic() + REFUSAL_RECHECK_S
        self._refused_state = self._headroom_state = self._state()
        self._refused_request = self._admitting
        self._refused_headroom = headroom

    def _known_refusal(self, blocks: int, exact: tuple[int, int, int, int] | None = None) -> bool:
        """Whether ``blocks`` would be refused as the last refusal was: at least as many
        blocks, no more room here than then (no more warm, free or parked blocks, no fewer
        committed pages: see :meth:`_state`), and within ``REFUSAL_RECHECK_S`` (the limit
        and the other engines' use can change unseen). With ``exact``, also only while the
        state is exactly that one (no block changed hands since).

        Why that is enough: the allocator takes warm blocks whenever they suffice, so the
        refusal needed a page commit the limit refused; with no more warm blocks and no
        less committed, the same commit is still past the same limit. An engine at its
        limit is refused the head of its queue on every step while its running requests
        take and free blocks, and asking the limit again each time costs a cold-path plan
        and a ledger check."""
        if not (0 < self._refused_blocks <= blocks and time.monotonic() < self._refused_until):
            return False
        state = self._state()
        if exact is not None and state != exact:
            return False
        warm, free, parked, uncommitted = state
        then_warm, then_free, then_parked, then_uncommitted = self._refused_state
        return (
            warm <= then_warm
            and free <= then_free
            and parked <= then_parked
            and uncommitted <= then_uncommitted
        )

    def _committed_bytes(self) -> int:
        return self.allocator.stats().committed_bytes

    def _room_for(self, blocks: int) -> bool:
        """Whether ``blocks`` more could be backed now, evicting parked prefix-cache blocks
        (never this allocation's hits) to make that room if needed."""
        while not self.allocator.can_allocate(blocks):
            if not self._evict_parked(blocks):
                return False
        return True

    def _back(self, need: int) -> bool:
        """Make the stash exactly ``need`` committed blocks; False (stash unchanged beyond a
        trim) when the policy or the commit refuses even after evicting parked blocks."""
        if self._free_batch:
            self._flush_frees()  # blocks freed earlier in this batch may be needed now
        if not self._stash:  # the usual case: one allocator call
            got = self.allocator.allocate(need)
            if got is not None:
                self._stash = got
                return True
            # Refused: make room before asking again (one refusal per attempt, as below).
            if not self._evict_parked(need):
                return False
        self._trim_stash(need)
        short = need - len(self._stash)
        while short > 0:
            got = self.allocator.allocate(short)
            if got is not None:
                self._stash.extend(got)
                return True
            if not self._evict_parked(short):
                return False
        return True

    def _trim_stash(self, keep: int) -> None:
        if len(self._stash) > keep:
            extra, self._stash = self._stash[keep:], self._stash[:keep]
            self.allocator.free(extra)

    def _evict_parked(self, count: int) -> bool:
        """Drop up to ``count`` least recently used parked blocks (never the prefix hits of
        the allocation being backed); False if none."""
        victims = list(itertools.islice((b for b in self._parked if b not in self._hits), count))
        if not victims:
            return False
        blocks = [self.blocks[b] for b in victims]
        for block in blocks:
            self._maybe_evict_cached_block(block)
            del self._parked[block.block_id]
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        self.allocator.free(victims)
        return True

    def track_requests(self, requests: dict[str, Any]) -> None:
        """The scheduler's requests by id (its own dict, read at admission): the headroom
        counts only the holders whose next token needs a new block."""
        self.tracked_requests = requests

    # -- pre-commit ahead of demand (scheduler hook) ------------------------------------------

    def forecast_demand(self, scheduler: Any) -> None:
        """A step was just planned: tell the allocator what the next one will likely take.
        Counted: one block per running request (its next block; an upper bound) and the
        blocks of every waiting request the next step could admit (tokens so far, no prefix
        hits: an upper bound too; no more than vLLM's own free blocks).

        Without the pre-commit thread this only matters while requests wait: the pages a
        finishing request frees then stay committed for them instead of being released and
        committed again a step later (churn at the limit). With no request waiting, the
        forecast is zero and the hot reserve keeps its usual maximum. With the thread
        (``ELASTICKV_PRECOMMIT``), the forecast always counts, and the thread commits those
        pages while this step runs instead of the next step waiting for them. Either way
        nothing goes past the limit, and pages go back once the demand is gone."""
        waiting = scheduler.waiting
        if waiting:
            running = len(scheduler.running)
            blocks = running
            # vLLM 0.32 admits up to max_num_active_reqs (default: max_num_running_reqs).
            limit = getattr(scheduler, "max_num_active_reqs", None)
            room = (limit or scheduler.max_num_running_reqs) - running
            if room > 0:
                size = self._block_tokens
                admissible = self.free_block_queue.num_free_blocks
                for request in itertools.islice(waiting, room):
                    blocks += -(-request.num_tokens // size)
                    if blocks >= admissible:
                        break
        elif self.allocator.precommits_in_background:
            blocks = len(scheduler.running)
        else:
            blocks = 0
        self.allocator.forecast(blocks)  # an unchanged forecast returns at once

    def idle_tick(self) -> int:
        """The engine waits for work (its idle ticks): no demand is left to keep pages hot
        for, and a lowered limit applies now (:meth:`sync_limit_idle`). Returns pages the
        limit released."""
        self.allocator.forecast(0)
        return self.sync_limit_idle()

    # -- batched frees (scheduler hook) -----------------------------------------------------

    def begin_free_batch(self) -> None:
        """The scheduler starts processing a step's output, where every finished request
        frees its blocks: collect the blocks that go back to the allocator and hand them over
        in one call at :meth:`end_free_batch` (one lock and one pass over the slabs instead of
        one per request). vLLM's own free queue is updated at once, as always."""
        if self._free_batch is None:
            self._free_batch = []

    def end_free_batch(self) -> None:
        """Hand the batch's blocks to the allocator and close the batch (closed first, so a
        failing free leaves no batch open)."""
        batch, self._free_batch = self._free_batch, None
        if batch:
            self._hand_over(batch)

    def _flush_frees(self) -> None:
        batch = self._free_batch
        if batch:
            self._free_batch = []
            self._hand_over(batch)

    def _hand_over(self, batch: list[int]) -> None:
        """Free a batch's blocks in one allocator call (a block listed twice, once)."""
        if len(set(batch)) != len(batch):
            batch = list(dict.fromkeys(batch))
        self.allocator.free(batch)

    # -- live limits and shutdown (scheduler hooks) ------------------------------------------

    def sync_limit(self) -> int:
        """Apply a limit an operator lowered (``elastickv limit``): drop hot pages, then
        evict parked prefix-cache blocks, while the ledger says the engine is over it. Once
        per scheduler step; reads the ledger at most every ``LIMIT_CHECK_INTERVAL_S``.
        Returns pages released."""
        if self._free_batch:
            self._flush_frees()
        if self.registration is None or self._in_window:
            return 0
        now = time.monotonic()
        if now < self._next_limit_check:
            return 0
        self._next_limit_check = now + LIMIT_CHECK_INTERVAL_S
        released = 0
        page = self.allocator.bytes_per_page
        while (over := self.registration.over_limit_bytes()) > 0:
            hot = self.allocator.stats().hot_pages
            trimmed = self.allocator.trim(max(0, hot - -(-over // page)))
            released += trimmed
            if trimmed == 0 and not self._evict_parked(max(1, -(-over // page))):
                self._log_draining(over)
                break  # only live blocks remain: they drain as requests finish
        if released:
            info = self.registration.handle.info()
            logger.info(
                "elastickv: %r applied its lowered limit %s: released %d pages (%s), "
                "%s committed now",
                self.registration.name,
                format_bytes(info.limit_effective),
                released,
                format_bytes(released * page),
                format_bytes(info.committed_bytes),
            )
        return released

    def _log_draining(self, over: int) -> None:
        """Once per limit revision: the engine is over its limit and only blocks in use
        remain; it will get under as requests finish."""
        assert self.registration is not None
        info = self.registration.handle.info()
        if info.limit_revision == self._draining_revision:
            return
        self._draining_revision = info.limit_revision
        logger.info(
            "elastickv: %r is %s over its limit %s with only blocks in use left: no new "
            "blocks until requests finish and free theirs",
            self.registration.name,
            format_bytes(over),
            format_bytes(info.limit_desired or 0),
        )

    def sync_limit_idle(self) -> int:
        """:meth:`sync_limit` while the engine waits for work (its idle ticks): always reads
        the ledger, and leaves the next scheduler step free to read it again, so a limit
        lowered just before a request arrives is applied before that request's blocks are
        placed."""
        self._next_limit_check = 0.0
        try:
            return self.sync_limit()
        finally:
            self._next_limit_check = 0.0

    def close_elastic(self) -> None:
        """Engine shutdown: return every page and unregister from the ledger."""
        self._flush_frees()
        self._trim_stash(0)
        if self.registration is not None:
            self.registration.close()  # closes the allocator first
        else:
            self.allocator.close()

    # -- vLLM's allocation and free paths ----------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        """vLLM's ``get_new_blocks`` on the blocks elastickv backed (the stash) instead of the
        free queue's first ones: they are taken out of the queue where they are, then treated
        exactly as vLLM treats the blocks it pops (reuse watchers, cached hashes, ref
        counts, metrics)."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        stash = self._stash
        if len(stash) < num_blocks:
            if not self._back(num_blocks):
                raise ElasticCapacityError(
                    f"cannot back {num_blocks} KV blocks now: the capacity policy refused "
                    f"(committed {self.allocator.stats().committed_bytes} bytes)"
                )
            stash = self._stash
        if len(stash) == num_blocks:
            chosen, self._stash = stash, []
        else:
            chosen = stash[:num_blocks]
            del stash[:num_blocks]
        every = self.blocks
        ret = [every[b] for b in chosen]
        remove = queue.remove
        for block in ret:
            if block.ref_cnt != 0:  # an accounting bug, never a silent double use of a block
                raise AssertionError(
                    f"elastickv backed block {block.block_id} that vLLM already uses"
                )
            remove(block)
        if self._reuse_watchers:
            self._notify_reuse(ret)
        metrics = self.metrics_collector
        if self.enable_caching:
            evict = self._maybe_evict_cached_block
            for block in ret:
                evict(block)
                block.ref_cnt += 1
                if metrics:
                    metrics.on_block_allocated(block)
        else:
            for block in ret:
                block.ref_cnt += 1
                if metrics:
                    metrics.on_block_allocated(block)
        return ret

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        self._released(blocks, check_pool=True)

    def _released(self, blocks: list[Any], *, check_pool: bool) -> None:
        """After vLLM's ``free_blocks``: blocks no request uses any more go back to the
        allocator, unless vLLM may still hand them out as prefix hits (parked)."""
        parked = self._parked
        park = self.enable_caching
        released: list[int] = []
        for block in blocks:
            if block.ref_cnt != 0 or block.is_null:
                continue
            block_id = block.block_id
            if block_id in parked or (
                check_pool and block.pool is not None and block.pool is not self
            ):
                continue
            if park and block.block_hash is not None:
                parked[block_id] = None
            else:
                released.append(block_id)
        if not released:
            return
        if len(released) > 1 and len(set(released)) != len(released):
            released = list(dict.fromkeys(released))  # a block listed twice is freed once
        if self._free_batch is not None:
            self._free_batch.extend(released)
        else:
            self.allocator.free(released)

    def unpin_blocks(self, blocks: Iterable[Any], on_reuse: Any) -> None:
        blocks = list(blocks)
        super().unpin_blocks(blocks, on_reuse)
        for block in blocks:
            if block.ref_cnt == 0:
                self._parked[block.block_id] = None  # still read until reused

    def touch(self, blocks: Any) -> None:
        super().touch(blocks)
        for block in blocks:
            if self._parked.pop(block.block_id, None) is None and not self.allocator.is_live(
                block.block_id
            ):
                logger.error(
                    "elastickv: vLLM reused block %d that elastickv had released (hash %s)",
                    block.block_id, block.block_hash,
                )  # fmt: skip

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        self._release_unhashed_parked(block_ids)

    def reset_prefix_cache(self) -> bool:
        ok = bool(super().reset_prefix_cache())
        if ok:
            self._release_unhashed_parked(list(self._parked))
        return ok

    def _release_unhashed_parked(self, block_ids: Iterable[int]) -> None:
        done = [
            b
            for b in block_ids
            if b in self._parked
            and self.blocks[b].block_hash is None
            and b not in self._reuse_watchers
        ]
        for b in done:
            del self._parked[b]
        if done:
            self.allocator.free(done)

    # -- introspection -----------------------------------------------------------------------

    def cached_blocks(self) -> int:
        """Backed blocks no request uses, kept for prefix-cache reuse (for metrics)."""
        return len(self._parked)

    def elastic_stats(self) -> dict[str, int]:
        """Counts a test or monitor can print: blocks by state, pages, kernel footprint."""
        self._flush_frees()
        stats: AllocatorStats = self.allocator.stats()
        return {
            "live_blocks": stats.live_blocks,
            "parked_blocks": len(self._parked),
            "stash_blocks": len(self._stash),
            "committed_pages": stats.committed_pages,
            "hot_pages": stats.hot_pages,
            "page_size": stats.page_size,
            "refusals": stats.refusals,
            "pages_committed": stats.pages_committed,
            "pages_precommitted": stats.pages_precommitted,
            "footprint_bytes": self.elastic_store.footprint_bytes(),
        }


def admission_headroom(manager: Any, request: Any) -> int:
    """Blocks to keep free when ``allocate_slots`` admits ``request``: one for every other
    request that holds blocks and fills them all, so its next token needs a new block (the
    pool knows the scheduler's requests from :meth:`ElasticBlockPool.track_requests`; without
    them, every other holder counts); 0 for a running request's own growth, or when vLLM's
    internals are not as expected.

    Why only those: a holder in the middle of a block takes no block in the next step, and
    counting every holder kept each batch a block per running request short of native
    vLLM's under a binding limit (64 requests at 32, 1.5 MiB on both sides: 0.67x native's
    throughput and 2.9x its TTFT; with this rule 0.75x and 1.6x)."""
    status = getattr(request, "status", _RUNNING)
    if status is _RUNNING or status == _RUNNING:  # identity first: the common, cheap case
        return 0
    try:
        single = manager.coordinator.single_type_managers[0]
        holders = single.req_to_blocks
    except (AttributeError, IndexError):
        return 0
    me = getattr(request, "request_id", None)
    requests = getattr(getattr(manager, "block_pool", None), "tracked_requests", None)
    if requests is None:
        holding: int = sum(map(bool, holders.values()))  # requests with blocks, counted in C
        if holders.get(me):
            holding -= 1  # not the request being admitted
        return holding
    size = single.block_size
    holding = 0
    for request_id, blocks in holders.items():
        if blocks and request_id != me:
            other = requests.get(request_id)
            if other is None or other.num_tokens >= len(blocks) * size:
                holding += 1
    return holding
