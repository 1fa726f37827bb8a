"""Stateful property test of the allocator on the real host backend.

Random sequences of alloc / free / resize / trim / budget and hot-reserve changes / injected
commit failures must keep: no block handed out twice; committed pages == pages under live
blocks + the null block's pages + the hot reserve; the kernel-reported footprint equals
committed pages x page size exactly; the policy's admitted bytes equal the committed bytes;
a refused or rolled-back allocation changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from alloc_cases import PAGE, FailingCommits, small_geometries
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from elastickv.alloc import BlockAllocator, FixedBudget
from elastickv.geometry import KVCacheGeometry
from elastickv.vmm import HostBackend, HostRange

GEOMETRIES = small_geometries()


@dataclass(frozen=True)
class Snapshot:
    live: frozenset[int]
    committed: frozenset[int]
    range_committed: frozenset[int]
    hot: frozenset[int]
    admitted: int
    footprint: int
    free_blocks: int


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.allocator: BlockAllocator | None = None
        self.vrange: HostRange | None = None
        self.requests: list[list[int]] = []
        self.tags: dict[int, int] = {}
        self.next_tag = 1

    @initialize(
        name=st.sampled_from(sorted(GEOMETRIES)),
        null=st.booleans(),
        hot=st.tuples(st.integers(0, 3), st.integers(0, 4)),
        budget_pages=st.integers(4, 20),
    )
    def setup(self, name: str, null: bool, hot: tuple[int, int], budget_pages: int) -> None:
        geometry = GEOMETRIES[name]
        self.geometry: KVCacheGeometry = geometry
        self.vrange = HostBackend(page_size=PAGE).reserve(geometry.backing_bytes)
        self.failing = FailingCommits(self.vrange)
        self.policy = FixedBudget(budget_pages * PAGE)
        low, high = min(hot), max(hot)
        self.allocator = BlockAllocator(
            geometry,
            self.vrange,
            self.policy,
            min_hot_pages=low,
            max_hot_pages=high,
            reserve_null_block=null,
        )
        self.null = null

    def teardown(self) -> None:
        if self.allocator is not None:
            self.allocator.close()
            assert self.policy.admitted_bytes == 0
        if self.vrange is not None:
            assert self.vrange.footprint_bytes() == 0
            self.vrange.close()

    # -- helpers ------------------------------------------------------------------------------

    @property
    def alloc(self) -> BlockAllocator:
        assert self.allocator is not None
        return self.allocator

    def snapshot(self) -> Snapshot:
        assert self.vrange is not None
        return Snapshot(
            live=self.alloc.live_blocks(),
            committed=self.alloc.committed_pages(),
            range_committed=self.vrange.committed_pages(),
            hot=self.alloc.hot_pages(),
            admitted=self.policy.admitted_bytes,
            footprint=self.vrange.footprint_bytes(),
            free_blocks=self.alloc.num_free_blocks,
        )

    def write_tag(self, block: int) -> None:
        assert self.vrange is not None
        tensor = self.vrange.as_tensor()
        tag = self.next_tag % 251 + 1
        self.next_tag += 1
        for start, end in self.geometry.block_byte_ranges(block):
            tensor[start] = tag
            tensor[end - 1] = tag
        self.tags[block] = tag

    def check_tag(self, block: int) -> None:
        assert self.vrange is not None
        tensor = self.vrange.as_tensor()
        for start, end in self.geometry.block_byte_ranges(block):
            assert int(tensor[start]) == self.tags[block]
            assert int(tensor[end - 1]) == self.tags[block]

    # -- rules --------------------------------------------------------------------------------

    @rule(n=st.integers(0, 14))
    def allocate(self, n: int) -> None:
        before = self.snapshot()
        blocks = self.alloc.allocate(n)
        if blocks is None:
            assert self.snapshot() == before, "a refused allocation changed state"
            return
        assert len(blocks) == n
        assert len(set(blocks)) == n
        assert not set(blocks) & before.live, "a live block was handed out again"
        assert all(b < self.alloc.num_usable_blocks for b in blocks)
        if self.null:
            assert 0 not in blocks
        for block in blocks:
            self.write_tag(block)
        if blocks:
            self.requests.append(blocks)

    @rule(data=st.data())
    def allocate_within_the_counted_room(self, data: st.DataObject) -> None:
        """``blocks_within`` is a promise: any count up to it is served under that much
        admission (an engine answers vLLM's free-block check from it, and vLLM then allocates
        without a way back)."""
        room = self.policy.available_bytes()
        bound = self.alloc.blocks_within(room)
        assert bound <= self.alloc.num_free_blocks
        cap = data.draw(st.integers(0, bound + 2))
        assert self.alloc.blocks_within(room, cap) == min(bound, cap)
        if not bound:
            return
        n = data.draw(st.integers(1, bound))
        blocks = self.alloc.allocate(n)
        assert blocks is not None, f"{n} blocks within the counted room {bound} were refused"
        for block in blocks:
            self.write_tag(block)
        self.requests.append(blocks)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.requests))
    def free(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.requests) - 1))
        request = self.requests[index]
        count = data.draw(st.integers(1, len(request)))
        gone, kept = request[:count], request[count:]
        for block in gone:
            self.check_tag(block)
        self.alloc.free(gone)
        if kept:
            self.requests[index] = kept
        else:
            del self.requests[index]

    @rule(data=st.data())
    @precondition(lambda self: bool(self.requests))
    def free_batch(self, data: st.DataObject) -> None:
        """What the vLLM block pool hands over after a scheduler step: several requests'
        blocks in one call, each request's in reverse (vLLM frees tail blocks first)."""
        chosen = data.draw(
            st.lists(st.integers(0, len(self.requests) - 1), min_size=1, max_size=4, unique=True)
        )
        gone = [b for index in chosen for b in reversed(self.requests[index])]
        for block in gone:
            self.check_tag(block)
        self.alloc.free(gone)
        self.requests = [r for i, r in enumerate(self.requests) if i not in set(chosen)]

    @rule(data=st.data())
    def free_invalid(self, data: st.DataObject) -> None:
        """A free with at least one block that is not live (a free one, the null block, an id
        out of range) or a live one listed twice, among live ones, in any order: it raises
        and nothing changes."""
        live = sorted(self.alloc.live_blocks())
        not_live = [b for b in range(self.geometry.num_blocks) if b not in set(live)]
        bad: st.SearchStrategy[int | tuple[int, int]] = st.sampled_from(
            [*not_live, -1, self.geometry.num_blocks, 10**9]
        )
        if live:
            bad = bad | st.sampled_from(live).map(lambda b: (b, b))  # repeated
        chosen = data.draw(st.lists(bad, min_size=1, max_size=3))
        good = data.draw(st.lists(st.sampled_from(live), max_size=6, unique=True)) if live else []
        blocks = [*good]
        for item in chosen:
            blocks.extend(item if isinstance(item, tuple) else (item,))
        blocks = data.draw(st.permutations(blocks))
        before = self.snapshot()
        with pytest.raises(ValueError):
            self.alloc.free(blocks)
        assert self.snapshot() == before

    @rule(n=st.integers(1, 14), after=st.integers(0, 3))
    def allocate_with_commit_failure(self, n: int, after: int) -> None:
        self.failing.arm(after)
        before = self.snapshot()
        blocks = self.alloc.allocate(n)
        fired = self.failing.armed is None
        self.failing.armed = None
        if blocks is None:
            assert self.snapshot() == before, "rollback left a trace"
        else:
            assert not fired, "an allocation succeeded although its commit failed"
            for block in blocks:
                self.write_tag(block)
            self.requests.append(blocks)

    @rule(fraction=st.floats(0.05, 1.0))
    def resize(self, fraction: float) -> None:
        size = max(1, round(self.geometry.num_blocks * fraction))
        self.alloc.resize(size)
        assert self.alloc.num_usable_blocks == size

    @rule(keep=st.integers(0, 2))
    def trim(self, keep: int) -> None:
        self.alloc.trim(keep)
        assert len(self.alloc.hot_pages()) <= keep

    @rule(pages=st.integers(1, 20))
    def change_budget(self, pages: int) -> None:
        self.policy.set_limit(pages * PAGE)

    @rule(hot=st.tuples(st.integers(0, 3), st.integers(0, 4)))
    def change_hot_reserve(self, hot: tuple[int, int]) -> None:
        self.alloc.set_hot_reserve(min(hot), max(hot))

    @rule()
    def precommit(self) -> None:
        before = len(self.alloc.hot_pages())
        done = self.alloc.precommit()
        assert len(self.alloc.hot_pages()) == before + done
        assert len(self.alloc.hot_pages()) <= self.alloc.hot_reserve_cap

    @rule(blocks=st.integers(0, 48))
    def forecast(self, blocks: int) -> None:
        """A scheduler's forecast: hot pages beyond the cap (an earlier, larger forecast)
        are gone at once (no thread here). Then the pre-commit round the thread would run:
        whatever it commits stays within the policy (the invariants) and the cap."""
        self.alloc.forecast(blocks)
        assert len(self.alloc.hot_pages()) <= self.alloc.hot_reserve_cap
        self.alloc.precommit()
        assert len(self.alloc.hot_pages()) <= self.alloc.hot_reserve_cap

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def accounting_is_exact(self) -> None:
        if self.allocator is None:
            return
        snap = self.snapshot()
        model_live = {b for r in self.requests for b in r}
        assert snap.live == model_live
        pmap = self.alloc.page_map
        under_live = pmap.pages_of_blocks(snap.live)
        null_pages = self.alloc.null_block_pages()
        assert not snap.hot & (under_live | null_pages)
        assert snap.committed == under_live | null_pages | snap.hot
        assert snap.range_committed == snap.committed
        assert snap.footprint == len(snap.committed) * PAGE
        assert snap.admitted == len(snap.committed) * PAGE
        assert len(snap.hot) <= self.alloc.hot_reserve_cap
        usable = self.alloc.num_usable_blocks
        expected_free = sum(
            1 for b in range(usable) if b not in snap.live and not (self.null and b == 0)
        )
        assert snap.free_blocks == expected_free
        stats = self.alloc.stats()
        assert stats.live_blocks == len(snap.live)
        assert stats.committed_pages == len(snap.committed)
        assert stats.hot_pages == len(snap.hot)


AllocatorMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("ELASTICKV_STATEFUL_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase
