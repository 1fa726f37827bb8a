"""Page grants and their followers: what the scheduler grants, each worker maps in its own real
range, in order, releases held until the work before them is done, and nothing lost or
applied twice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.alloc import BlockAllocator, FixedBudget
from elastickv.geometry import KVCacheGeometry
from elastickv.vmm import CommitError, HostBackend, HostRange, VmmError
from elastickv.vmm.grants import GrantFollower, GrantOrderError, PageGrants, PageOps

PAGE = 64 * 1024
# 8 KiB per (layer, block) over 2 layers: 8 blocks share a page in each layer.
GEOMETRY = KVCacheGeometry(num_layers=2, num_blocks=64, num_kv_heads=2, block_size=16, head_size=64)


def test_page_ops_are_plain_pairs() -> None:
    ops = PageOps(3, (0, 2, 5, -1, 9, 3))
    assert list(ops.items()) == [(0, 2), (5, -1), (9, 3)]
    assert (ops.committed_pages, ops.released_pages) == (5, 1)
    with pytest.raises(ValueError, match="pairs"):
        PageOps(1, (0, 2, 5))


def test_grants_record_in_order_and_number_batches() -> None:
    grants = PageGrants(16 * PAGE, PAGE, ranks=2, held=[0])
    assert grants.bytes_per_page == 2 * PAGE and grants.granted_pages() == 1
    assert grants.drain() is None  # nothing changed: nothing to send
    grants.commit([0, 1, 2, 7])
    grants.release([1])
    assert grants.pending
    first = grants.drain()
    assert first == PageOps(1, (0, 3, 7, 1, 1, -1))
    assert grants.granted_pages() == 3 and grants.footprint_bytes() == 6 * PAGE
    grants.commit([1])
    second = grants.drain()
    assert second is not None and second.seq == 2
    with pytest.raises(VmmError, match="no memory in this process"):
        grants.as_tensor()


def test_a_follower_refuses_a_batch_out_of_order() -> None:
    with HostBackend(PAGE).reserve(8 * PAGE) as vrange:
        follower = GrantFollower(vrange)
        follower.apply(PageOps(1, (0, 1)))
        with pytest.raises(GrantOrderError, match="batch 3 arrived after batch 1"):
            follower.apply(PageOps(3, (1, 1)))
        with pytest.raises(GrantOrderError, match="batch 1 arrived after batch 1"):
            follower.apply(PageOps(1, (1, 1)))  # a repeat
        follower.apply(PageOps(2, (1, 1)))
        assert vrange.committed_pages() == {0, 1} and follower.seq == 2


def test_a_failed_commit_is_the_ranges_error_and_leaves_nothing_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with HostBackend(PAGE).reserve(8 * PAGE) as vrange:
        real = vrange._commit_run

        def second_run_fails(first: int, count: int) -> None:
            if first == 3:
                raise CommitError("no memory for page 3 (injected)")
            real(first, count)

        monkeypatch.setattr(vrange, "_commit_run", second_run_fails)
        follower = GrantFollower(vrange)
        with pytest.raises(CommitError, match="injected"):
            follower.apply(PageOps(1, (0, 1, 3, 1)))
        assert vrange.committed_pages() == frozenset()  # the range rolled its batch back
        assert follower.seq == 0  # the batch was not applied: the engine must stop


@settings(max_examples=60, deadline=None)
@given(
    script=st.lists(
        st.tuples(st.sampled_from(["take", "free", "step", "done"]), st.integers(1, 12)),
        min_size=1,
        max_size=60,
    ),
    fenced=st.booleans(),
    budget=st.integers(2, 16),
)
def test_a_follower_holds_what_was_granted(
    script: list[tuple[str, int]], fenced: bool, budget: int
) -> None:
    """An allocator over grants, its batches applied step by step to a real host range: after
    every step the worker holds the granted pages, plus (with a fence, as on a GPU running a
    step ahead) released pages until the steps before their release are done; a page granted
    again while held stays mapped; once settled, exactly the granted pages."""
    grants = PageGrants(GEOMETRY.backing_bytes, PAGE)
    alloc = BlockAllocator(GEOMETRY, grants, FixedBudget(budget * PAGE), max_hot_pages=1)
    completed = [0]
    steps = [0]

    def mark_step() -> object:
        steps[0] += 1
        return steps[0]

    def done(token: object) -> bool:
        assert isinstance(token, int)
        return token <= completed[0]

    with HostBackend(PAGE).reserve(GEOMETRY.backing_bytes) as vrange:
        assert isinstance(vrange, HostRange)
        follower = (
            GrantFollower(vrange, mark_step=mark_step, done=done, wait=lambda: None)
            if fenced
            else GrantFollower(vrange)
        )
        held: list[list[int]] = []
        expected: dict[int, int] = {}  # pages the follower must still hold: their fence
        for op, n in script:
            if op == "take":
                blocks = alloc.allocate(n)
                if blocks is not None:
                    held.append(blocks)
            elif op == "free" and held:
                alloc.free(held.pop(n % len(held)))
            elif op == "done":
                completed[0] = steps[0]  # every step queued so far has finished
            ops = grants.drain()
            # The model: a released page waits for the last step queued before its batch.
            for first, count in [] if ops is None else ops.items():
                for page in range(first, first + abs(count)):
                    if count < 0:
                        expected[page] = steps[0]
                    else:
                        expected.pop(page, None)
            for page in [p for p, fence in expected.items() if not fenced or fence <= completed[0]]:
                del expected[page]
            follower.apply(ops)
            follower.step_queued()
            mapped = vrange.committed_pages()
            granted = alloc.committed_pages()
            assert follower.held_pages == set(expected)
            assert mapped == granted | follower.held_pages
            assert not follower.held_pages & granted  # granted again: no longer held
            assert vrange.footprint_bytes() == len(mapped) * PAGE
        follower.settle()
        assert vrange.committed_pages() == alloc.committed_pages()
        alloc.close()
        follower.apply(grants.drain())
        follower.settle()
        assert vrange.committed_pages() == frozenset()
