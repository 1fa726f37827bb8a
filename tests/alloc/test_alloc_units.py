"""Allocator behaviour on the real host backend: exhaustion, placement, release, resize,
threads and the background pre-commit thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from alloc_cases import PAGE, FailingCommits, small_geometries

from elastickv.alloc import BlockAllocator, FixedBudget, PageMap, Unlimited
from elastickv.geometry import KVCacheGeometry
from elastickv.vmm import HostBackend, HostRange

# 8 KiB per (layer, block), 2 layers: a slab is 8 blocks on 2 pages.
GEOMETRY = small_geometries()["per_layer_hnd"]


@pytest.fixture
def vrange() -> Iterator[HostRange]:
    with HostBackend(page_size=PAGE).reserve(GEOMETRY.backing_bytes) as reserved:
        yield reserved


def test_page_map_groups_blocks_sharing_pages() -> None:
    pmap = PageMap(GEOMETRY, PAGE)
    assert pmap.num_slabs == 5
    assert pmap.slab_blocks[0] == tuple(range(8))
    assert pmap.pages_of_block(9) == (1, 6)
    assert pmap.blocks_on_page(6) == list(range(8, 16))
    for name, geometry in small_geometries().items():
        pmap = PageMap(geometry, PAGE)
        for block in range(geometry.num_blocks):
            assert list(pmap.pages_of_block(block)) == geometry.block_pages(block, PAGE), name
    with pytest.raises(AttributeError):
        pmap.page_size = 1


def test_null_block_is_reserved_and_committed(vrange: HostRange) -> None:
    with BlockAllocator(GEOMETRY, vrange) as alloc:
        assert alloc.num_free_blocks == GEOMETRY.num_blocks - 1
        assert alloc.committed_pages() == {0, 5}
        assert vrange.footprint_bytes() == 2 * PAGE
        blocks = alloc.allocate(GEOMETRY.num_blocks - 1)
        assert blocks is not None and 0 not in blocks
        with pytest.raises(ValueError):
            alloc.free([0])


def test_freeing_nothing_changes_nothing(vrange: HostRange) -> None:
    """``free([])`` (a request that held no block) was a ValueError from ``max()``."""
    with BlockAllocator(GEOMETRY, vrange) as alloc:
        held = alloc.allocate(3)
        assert held is not None
        before = (alloc.live_blocks(), alloc.num_free_blocks, alloc.stats().frees)
        alloc.free([])
        alloc.free(set())
        alloc.free(())
        assert (alloc.live_blocks(), alloc.num_free_blocks, alloc.stats().frees) == before


def test_exhaustion_returns_none_and_counts_a_refusal(vrange: HostRange) -> None:
    with BlockAllocator(GEOMETRY, vrange) as alloc:
        assert alloc.allocate(GEOMETRY.num_blocks) is None
        assert alloc.allocate(GEOMETRY.num_blocks - 1) is not None
        assert alloc.allocate(1) is None
        assert not alloc.can_allocate(1)
        assert alloc.stats().refusals == 2


def test_budget_refusal_is_not_now(vrange: HostRange) -> None:
    policy = FixedBudget(4 * PAGE)  # the null slab + one more slab
    with BlockAllocator(GEOMETRY, vrange, policy) as alloc:
        first = alloc.allocate(7 + 8)
        assert first is not None
        assert alloc.can_allocate(0) and not alloc.can_allocate(1)
        assert alloc.allocate(1) is None
        assert policy.admitted_bytes == 4 * PAGE
        policy.set_limit(6 * PAGE)
        assert alloc.can_allocate(8)
        assert alloc.allocate(8) is not None


def test_best_fit_keeps_requests_on_few_pages(vrange: HostRange) -> None:
    with BlockAllocator(GEOMETRY, vrange, max_hot_pages=10) as alloc:
        pmap = alloc.page_map
        a = alloc.allocate(3)
        b = alloc.allocate(5)
        assert a is not None and b is not None
        # The null slab has 7 free blocks: both requests land there or in one other slab.
        assert len({pmap.block_slab[x] for x in a}) == 1
        assert len({pmap.block_slab[x] for x in b}) == 1
        c = alloc.allocate(4)  # fits in what is left of the slab holding ``a`` or ``b``
        assert c is not None
        assert len({pmap.block_slab[x] for x in c}) == 1
        assert len(alloc.committed_pages()) <= 4
        big = alloc.allocate(16)  # two whole slabs, not scraps of four
        assert big is not None
        assert len({pmap.block_slab[x] for x in big}) <= 3


def test_freed_memory_really_leaves(vrange: HostRange) -> None:
    with BlockAllocator(GEOMETRY, vrange, min_hot_pages=0, max_hot_pages=2) as alloc:
        blocks = alloc.allocate(GEOMETRY.num_blocks - 1)
        assert blocks is not None
        tensor = vrange.as_tensor()
        for start, end in GEOMETRY.block_byte_ranges(blocks[-1]):
            tensor[start:end] = 7
        assert vrange.footprint_bytes() == 10 * PAGE
        alloc.free(blocks)
        # Null block's 2 pages + a hot reserve of at most 2 pages remain.
        assert alloc.committed_pages() == alloc.null_block_pages() | alloc.hot_pages()
        assert len(alloc.hot_pages()) == 2
        assert vrange.footprint_bytes() == 4 * PAGE
        assert alloc.trim() == 2
        assert vrange.footprint_bytes() == 2 * PAGE


def test_one_free_over_several_slabs_drains_the_slab_being_filled(vrange: HostRange) -> None:
    """A request's blocks freed in reverse, spanning the slab being filled (the cursor) and
    another: the cursor slab goes idle, returns to the buckets and its pages leave."""
    with BlockAllocator(GEOMETRY, vrange, max_hot_pages=0) as alloc:
        slab_of = alloc.page_map.block_slab
        first = alloc.allocate(7)  # the rest of the null block's slab
        prompt = alloc.allocate(3)  # a fresh slab
        grown = alloc.allocate(2)  # the same slab, which is now being filled
        more = alloc.allocate(1)
        assert first and prompt and grown and more
        assert len({slab_of[b] for b in prompt + grown + more}) == 1
        assert vrange.footprint_bytes() == 4 * PAGE
        alloc.free([*reversed(prompt + grown + more), *reversed(first[:2])])
        assert alloc.live_blocks() == set(first[2:])
        assert alloc.committed_pages() == alloc.null_block_pages()
        assert vrange.footprint_bytes() == 2 * PAGE
        assert alloc.num_free_blocks == GEOMETRY.num_blocks - 1 - 5
        again = alloc.allocate(8)  # a whole slab: its pages are committed again
        assert again is not None and len({slab_of[b] for b in again}) == 1
        assert vrange.footprint_bytes() == 4 * PAGE
        with pytest.raises(ValueError):
            alloc.free([again[0], again[1], again[0]])  # repeated: nothing is freed
        with pytest.raises(ValueError):
            alloc.free([again[0], prompt[0]])  # not live: nothing is freed
        assert alloc.live_blocks() == set(first[2:]) | set(again)


def test_every_layout_releases_to_the_null_pages() -> None:
    for name, geometry in small_geometries().items():
        with HostBackend(page_size=PAGE).reserve(geometry.backing_bytes) as vrange:
            policy = Unlimited()
            alloc = BlockAllocator(geometry, vrange, policy)
            blocks = alloc.allocate(geometry.num_blocks - 1)
            assert blocks is not None, name
            assert vrange.footprint_bytes() == len(alloc.committed_pages()) * PAGE
            alloc.free(blocks)
            assert alloc.committed_pages() == alloc.null_block_pages(), name
            assert vrange.footprint_bytes() == len(alloc.null_block_pages()) * PAGE, name
            alloc.close()
            assert policy.admitted_bytes == 0 and vrange.footprint_bytes() == 0


def test_commit_failure_mid_way_rolls_back(vrange: HostRange) -> None:
    failing = FailingCommits(vrange)
    policy = FixedBudget(100 * PAGE)
    with BlockAllocator(GEOMETRY, vrange, policy) as alloc:
        failing.arm(after=3)
        assert alloc.allocate(30) is None
        assert failing.fired == 1
        assert alloc.committed_pages() == {0, 5} == vrange.committed_pages()
        assert policy.admitted_bytes == 2 * PAGE
        assert vrange.footprint_bytes() == 2 * PAGE
        assert alloc.live_blocks() == frozenset()
        stats = alloc.stats()
        assert stats.rollbacks == 1 and stats.last_error is not None
        assert alloc.allocate(30) is not None


def test_resize_grows_and_shrinks_lazily(vrange: HostRange) -> None:
    with BlockAllocator(GEOMETRY, vrange) as alloc:
        blocks = alloc.allocate(39)
        assert blocks is not None
        alloc.resize(16)
        assert alloc.num_free_blocks == 0
        high = [b for b in blocks if b >= 16]
        alloc.free(high)  # lazily dropped: they do not come back
        assert alloc.num_free_blocks == 0
        assert alloc.allocate(1) is None
        low = [b for b in blocks if b < 16]
        alloc.free(low[:4])
        assert alloc.num_free_blocks == 4
        again = alloc.allocate(4)
        assert again is not None and max(again) < 16
        alloc.resize(40)
        assert alloc.num_free_blocks == 40 - 16
        grown = alloc.allocate(24)
        assert grown is not None and min(grown) >= 16
        with pytest.raises(ValueError):
            alloc.resize(0)


def test_shared_policy_between_allocators() -> None:
    backend = HostBackend(page_size=PAGE)
    policy = FixedBudget(6 * PAGE)
    with (
        backend.reserve(GEOMETRY.backing_bytes) as r1,
        backend.reserve(GEOMETRY.backing_bytes) as r2,
    ):
        a1 = BlockAllocator(GEOMETRY, r1, policy)
        a2 = BlockAllocator(GEOMETRY, r2, policy)
        assert policy.admitted_bytes == 4 * PAGE
        assert a1.allocate(15) is not None  # one more slab: 2 pages
        assert a2.allocate(8) is None  # would need 2 more pages
        assert policy.admitted_bytes == r1.footprint_bytes() + r2.footprint_bytes()
        a1.close()
        a2.close()
        assert policy.admitted_bytes == 0


def test_concurrent_alloc_free_keeps_invariants() -> None:
    geometry = KVCacheGeometry(
        num_layers=2, num_blocks=400, num_kv_heads=2, block_size=16, head_size=64
    )
    policy = FixedBudget(80 * PAGE)
    errors: list[BaseException] = []
    with HostBackend(page_size=PAGE).reserve(geometry.backing_bytes) as vrange:
        alloc = BlockAllocator(geometry, vrange, policy, max_hot_pages=4)
        owned: list[set[int]] = [set() for _ in range(4)]

        def worker(me: int) -> None:
            try:
                for step in range(400):
                    got = alloc.allocate(1 + (step * 7 + me) % 13)
                    if got is not None:
                        owned[me].update(got)
                    if owned[me] and step % 3:
                        give = sorted(owned[me])[: 1 + step % 11]
                        alloc.free(give)
                        owned[me].difference_update(give)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        everything = [b for blocks in owned for b in blocks]
        assert len(everything) == len(set(everything)), "a block was handed out twice"
        assert alloc.live_blocks() == set(everything)
        committed = alloc.committed_pages()
        live_pages = alloc.page_map.pages_of_blocks(set(everything))
        assert committed == live_pages | alloc.null_block_pages() | alloc.hot_pages()
        assert vrange.committed_pages() == committed
        assert vrange.footprint_bytes() == len(committed) * PAGE == policy.admitted_bytes
        alloc.close()
        assert policy.admitted_bytes == 0


def test_forecast_commits_ahead_within_the_policy_and_gives_back(vrange: HostRange) -> None:
    """Pages for a forecast demand are committed before the allocation that needs them (it
    then commits nothing), never past the policy, and go back once the forecast drops."""
    budget = FixedBudget(6 * PAGE)
    with BlockAllocator(GEOMETRY, vrange, budget, max_hot_pages=0) as alloc:
        commits: list[float] = []
        alloc.commit_observer = commits.append
        alloc.forecast(12)  # the null slab's 7 free blocks + one more slab (2 pages)
        assert alloc.hot_reserve_cap == 3  # 12 of 40 blocks on 10 pages, rounded up
        assert alloc.precommit() == 2
        assert len(alloc.hot_pages()) == 2 and len(commits) == 1
        blocks = alloc.allocate(12)
        assert blocks is not None and len(commits) == 1  # served from pages committed ahead
        alloc.forecast(40)  # more than the 6-page budget holds
        assert alloc.precommit() == 2  # one more slab, then the policy refuses
        assert vrange.footprint_bytes() == 6 * PAGE == budget.admitted_bytes
        alloc.free(blocks)  # the forecast still wants its pages: they stay hot
        assert len(alloc.committed_pages()) == 6
        alloc.forecast(0)  # the demand went away: the next round gives the pages back
        assert alloc.precommit() == 0
        assert alloc.hot_pages() == frozenset()
        assert alloc.committed_pages() == alloc.null_block_pages()
        assert alloc.stats().pages_precommitted == 4
        with pytest.raises(ValueError, match=">= 0"):
            alloc.forecast(-1)


def test_forecast_keeps_freed_pages_hot_until_it_drops(vrange: HostRange) -> None:
    """Without the thread a forecast commits nothing ahead, but pages freed while it stands
    stay hot up to its pages (an engine at its limit with requests waiting takes them again
    a step later), and go back as soon as it drops, with no free needed to notice."""
    with BlockAllocator(GEOMETRY, vrange, max_hot_pages=0) as alloc:
        blocks = alloc.allocate(23)  # the null slab's 7 free blocks + two whole slabs
        assert blocks is not None
        committed = alloc.stats().pages_committed
        alloc.forecast(16)  # 16 of 40 blocks on 10 pages: 4 pages
        assert alloc.stats().pages_committed == committed and alloc.hot_reserve_cap == 4
        alloc.free(blocks)
        assert len(alloc.hot_pages()) == 4 and alloc.stats().pages_released == 0
        assert alloc.allocate(16) is not None  # taken again: nothing committed
        assert alloc.stats().pages_committed == committed
        alloc.free(alloc.live_blocks() - {0})
        alloc.forecast(0)
        assert alloc.hot_pages() == frozenset() and alloc.forecast_blocks == 0
        assert alloc.committed_pages() == alloc.null_block_pages()


def test_floor_and_commit_observer(vrange: HostRange) -> None:
    """The floor is the null slab's pages (known from the page map alone); every page commit
    (not a refusal, not a block served from committed pages) reaches the observer."""
    from elastickv.alloc import null_floor_bytes

    with BlockAllocator(GEOMETRY, vrange, FixedBudget(4 * PAGE)) as alloc:
        assert alloc.floor_bytes() == null_floor_bytes(alloc.page_map) == 2 * PAGE
        seen: list[float] = []
        alloc.commit_observer = seen.append
        assert alloc.allocate(7) is not None  # the rest of the null slab: nothing to commit
        assert seen == []
        assert alloc.allocate(1) is not None  # commits the next slab's pages
        assert len(seen) == 1 and seen[0] > 0
        assert alloc.allocate(1) is not None  # on pages already committed
        assert len(seen) == 1
        assert alloc.allocate(GEOMETRY.num_blocks - 10) is None  # refused by the budget
        assert len(seen) == 1
