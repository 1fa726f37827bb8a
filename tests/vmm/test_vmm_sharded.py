"""A sharded range (one page index on every tensor-parallel rank) over real host pools: every
rank holds exactly the pages the group says are committed, a rank that fails rolls the
others back, and the kernel's footprint of each rank follows."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.alloc import BlockAllocator, FixedBudget
from elastickv.geometry import KVCacheGeometry
from elastickv.vmm import CommitError, HostBackend, HostRange, ShardedRange, VmmError

PAGES = 12

operations = st.lists(
    st.tuples(
        st.sampled_from(["commit", "release"]),
        st.sets(st.integers(min_value=0, max_value=PAGES - 1), max_size=PAGES),
    ),
    max_size=20,
)


def _reserve(ranks: int, pages: int = PAGES) -> tuple[ShardedRange, list[HostRange]]:
    backend = HostBackend()
    shards = [backend.reserve(pages * backend.page_size) for _ in range(ranks)]
    return ShardedRange(shards), shards


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(min_value=1, max_value=4), ops=operations)
def test_every_rank_holds_exactly_the_group_pages(
    ranks: int, ops: list[tuple[str, set[int]]]
) -> None:
    group, shards = _reserve(ranks)
    page = group.page_size
    model: set[int] = set()
    with group:
        for op, pages in ops:
            if op == "commit":
                assert group.commit(pages) == len(pages - model)
                model |= pages
            else:
                assert group.release(pages) == len(pages & model)
                model -= pages
            assert group.committed_pages() == model
            for shard in shards:
                assert shard.committed_pages() == model
                assert shard.footprint_bytes() == len(model) * page
            assert group.committed_bytes() == len(model) * page * ranks
            assert group.footprint_bytes() == len(model) * page * ranks
    assert all(shard.closed for shard in shards)


def _fail_commits(shard: HostRange) -> None:
    """A real rank's range whose commits now fail, as a device out of memory would."""

    def commit(pages: Iterable[int]) -> int:
        raise CommitError("injected: this rank's device is out of memory")

    shard.commit = commit  # type: ignore[method-assign]


@pytest.mark.parametrize("failing_rank", [0, 1, 2])
def test_a_failing_rank_rolls_back_the_others(failing_rank: int) -> None:
    group, shards = _reserve(3)
    with group:
        group.commit([0])
        _fail_commits(shards[failing_rank])
        with pytest.raises(CommitError, match="injected"):
            group.commit([3, 4, 5])
        assert group.committed_pages() == {0}
        for rank, shard in enumerate(shards):
            if rank != failing_rank:
                assert shard.committed_pages() == {0}, rank
                assert shard.footprint_bytes() == shard.page_size, rank


def test_allocator_charges_every_rank_and_refuses_as_one() -> None:
    """One block of a 2-rank engine costs its pages twice; a budget counts both ranks."""
    geometry = KVCacheGeometry(
        num_blocks=64, block_size=16, num_kv_heads=1, head_size=64, num_layers=2, dtype="float16"
    )
    backend = HostBackend()
    page = backend.page_size
    shards = [backend.reserve(geometry.backing_bytes) for _ in range(2)]
    group = ShardedRange(shards)
    budget = FixedBudget(8 * page)
    with group, BlockAllocator(geometry, group, budget) as alloc:
        assert alloc.bytes_per_page == 2 * page
        floor = alloc.floor_bytes()
        assert floor == 2 * len(alloc.committed_pages()) * page
        assert budget.admitted_bytes == floor == group.footprint_bytes()
        granted = 0
        while alloc.allocate(1) is not None:
            granted += 1
            assert budget.admitted_bytes == group.footprint_bytes() <= 8 * page
            for shard in shards:
                assert shard.footprint_bytes() * 2 == group.footprint_bytes()
        assert granted > 0
        assert alloc.stats().committed_bytes == budget.admitted_bytes
    assert budget.admitted_bytes == 0


def test_ranks_must_hold_the_same_pool() -> None:
    backend = HostBackend()
    with (
        backend.reserve(4 * backend.page_size) as a,
        backend.reserve(8 * backend.page_size) as b,
        pytest.raises(ValueError, match="rank 1's range has 8 pages"),
    ):
        ShardedRange([a, b])
    with pytest.raises(ValueError, match="at least one"):
        ShardedRange([])


def test_a_sharded_range_has_no_single_tensor() -> None:
    group, _ = _reserve(2)
    with group, pytest.raises(VmmError, match="one tensor per rank"):
        group.as_tensor()
