"""The elastic block pool against vLLM 0.32's own ``BlockPool`` machinery, driven the way
``KVCacheManager.allocate_slots`` drives it, without an engine: its free-block count is a
promise (what it counts can always be taken), credit follows demand in a real ledger, a
step's page operations reach a worker's range exactly, and prefix-cache hits on parked
blocks are never evicted to make room for new blocks.

(That last one: backing new blocks once evicted the hit blocks, the least recently used
parked ones; vLLM then took them back with ``touch`` while elastickv handed them out again,
and the engine died with "remove() called on an invalid block", seen under
``elastickv serve`` with three models on a tight budget.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from elastickv.control import open_ledger
from elastickv.control.credit import CreditPolicy
from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.scheduler.store import (
    REGISTRY,
    ElasticStore,
    PolicyFactory,
    local_policy,
)
from elastickv.vmm import HostBackend, host_granularity
from elastickv.vmm.grants import GrantFollower

PAGE = host_granularity()


def geometry_of(num_blocks: int, blocks_per_page: int = 1) -> KVCacheGeometry:
    """1 layer, 1 KV head, 16 tokens of 2×(PAGE/128 or /256) fp32: a page's worth or half."""
    geometry = KVCacheGeometry(
        num_layers=1, num_blocks=num_blocks, num_kv_heads=1, block_size=16,
        head_size=PAGE // (128 * blocks_per_page), dtype="float32", layout="HND",
    )  # fmt: skip
    assert geometry.backing_bytes * blocks_per_page == num_blocks * PAGE
    return geometry


def make_pool(
    num_blocks: int,
    budget_pages: int | None,
    *,
    blocks_per_page: int = 1,
    hot_max_pages: int = 0,
    policy: PolicyFactory = local_policy,
) -> Any:
    """An elastic pool of ``num_blocks`` blocks, ``blocks_per_page`` blocks per page (1 or
    2), ``budget_pages`` pages allowed (the null block takes one; None: no budget),
    ``hot_max_pages`` freed pages kept."""
    from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool

    geometry = geometry_of(num_blocks, blocks_per_page)
    config = ElasticConfig(
        page_size=PAGE,
        budget_bytes=None if budget_pages is None else budget_pages * PAGE,
        hot_max_pages=hot_max_pages,
    )
    store = ElasticStore.for_workers(config, geometry, geometry.backing_bytes, 1, "host", policy)
    REGISTRY.publish(store)
    return ElasticBlockPool(num_blocks, True, 16)


@pytest.fixture
def pool() -> Iterator[Any]:
    made = make_pool(32, 5)
    yield made
    made.close_elastic()


def allocate(pool: Any, num: int, hits: list[Any]) -> list[Any] | None:
    """What ``allocate_slots`` does: the fit check (vLLM counts a prefix hit no request uses
    among the blocks to allocate, as touching it takes it out of the free queue), then touch
    the hits and take the new blocks."""
    need = num + sum(1 for block in hits if block.ref_cnt == 0)
    if need > pool.get_num_free_blocks():
        return None
    pool.touch(hits)
    got: list[Any] = pool.get_new_blocks(num) if num else []
    return got


class _Waiting(list[Any]):
    """A waiting queue with vLLM's ``peek_request``."""

    def peek_request(self) -> Any:
        return self[0]


def waiting_request(request_id: str, num_tokens: int) -> Any:
    return SimpleNamespace(request_id=request_id, num_tokens=num_tokens, num_computed_tokens=0)


def scheduler_of(pool: Any, running: int, waiting: list[int], **fields: Any) -> Any:
    """The scheduler fields the pool reads: running requests (each with one token to
    compute), waiting prompts of ``waiting`` tokens, its token budget and request limit."""
    return SimpleNamespace(
        running=[
            SimpleNamespace(request_id=f"r{i}", num_tokens=1, num_computed_tokens=0)
            for i in range(running)
        ],
        waiting=_Waiting(waiting_request(f"w{i}", n) for i, n in enumerate(waiting)),
        max_num_scheduled_tokens=fields.get("budget", 64),
        max_num_running_reqs=fields.get("max_running", 8),
        requests={},
        finished_req_ids=set(),
        kv_cache_manager=SimpleNamespace(watermark_blocks=0, coordinator=None),
    )


def test_prefix_hits_are_not_evicted_to_back_new_blocks(pool: Any) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    first = allocate(pool, 3, [])
    assert first is not None
    for i, block in enumerate(first):  # the request's full blocks enter the prefix cache
        key = make_block_hash_with_group_id(BlockHash(bytes([i + 1]) * 32), 0)
        pool._insert_block_hash(key, block, num_tokens=16)
    pool.free_blocks(reversed(first))
    assert pool.elastic_stats()["parked_blocks"] == 3
    # null block + 3 parked = 4 of 5 pages: the next request hits all 3 and needs 2 more.
    assert allocate(pool, 2, first) is None  # "cannot schedule now", not a crash
    stats = pool.elastic_stats()
    assert stats["parked_blocks"] == 3 and stats["live_blocks"] == 3  # (the null block apart)
    assert all(b.block_hash is not None for b in first)
    # With one new block it fits; the hits are reused, the new block is another one.
    second = allocate(pool, 1, first)
    assert second is not None
    assert {b.block_id for b in second}.isdisjoint(b.block_id for b in first)
    assert all(b.ref_cnt == 1 for b in [*first, *second])
    assert pool.elastic_stats()["parked_blocks"] == 0


def counted_now(pool: Any) -> int:
    """The free count computed afresh from the pool's books (no answer kept)."""
    free: int = pool.free_block_queue.num_free_blocks
    room: int = pool.allocator._count_within(pool.elastic_store.policy.available_bytes(), free)
    parked: int = pool.elastic_stats()["parked_blocks"]
    return min(free, room + parked)


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(2, 24),
    blocks_per_page=st.sampled_from([1, 2]),
    script=st.lists(st.tuples(st.sampled_from("tfh"), st.integers(0, 6)), min_size=1, max_size=30),
)
def test_the_free_count_is_a_promise(
    budget: int, blocks_per_page: int, script: list[tuple[str, int]]
) -> None:
    """Whatever was taken (t), freed into the prefix cache or released (f), or taken back
    as a prefix hit (h) before: vLLM may take as many blocks as the pool counts free,
    evicting parked blocks for them if it must, and never more than its budget holds; and
    the count it keeps between asks is the count made afresh."""
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    made = make_pool(24, budget, blocks_per_page=blocks_per_page, hot_max_pages=1)
    held: list[list[Any]] = []
    hashes = 0
    try:
        for action, n in script:
            parked = [made.blocks[b] for b in made._parked]
            if action == "h" and parked:
                hit = parked[n % len(parked)]
                if allocate(made, 0, [hit]) is not None:  # touched: in use again
                    held.append([hit])
            elif action == "t" or not held:
                free = made.get_num_free_blocks()
                assert free == counted_now(made)
                got = made.get_new_blocks(min(n, free))
                held.append(got)
                assert made.allocator.stats().committed_bytes <= budget * PAGE
            else:
                blocks = held.pop(n % len(held))
                for block in blocks[: n % 3]:
                    if block.block_hash is None:
                        hashes += 1
                        digest = BlockHash(hashes.to_bytes(32, "big"))
                        key = make_block_hash_with_group_id(digest, 0)
                        made._insert_block_hash(key, block, num_tokens=16)
                made.free_blocks(reversed(blocks))
            free = made.get_num_free_blocks()
            assert free == counted_now(made)  # the answer kept between asks is not stale
            extra = made.get_new_blocks(free)  # all of it, at once
            assert len(extra) == free
            assert made.allocator.stats().committed_bytes <= budget * PAGE
            made.free_blocks(reversed(extra))
    finally:
        made.close_elastic()


def test_credit_follows_the_steps_demand_in_the_ledger(tmp_path: Path) -> None:
    """With the ledger, the pool holds credit for the step's demand (one ledger operation),
    counts free blocks from it exactly, gives it back once the engine idles, and gives it
    back first when its limit is lowered."""
    with open_ledger(directory=str(tmp_path), total_bytes=64 * PAGE, utilization=1.0) as ledger:
        handle = ledger.register("engine")
        made = make_pool(32, None, policy=lambda config, device: CreditPolicy(handle))
        try:
            assert made.credit is not None and made.credit.credit_bytes == 0
            assert handle.info().committed_bytes == PAGE  # the null block, published
            assert made.get_num_free_blocks() == 0  # no credit yet: nothing counted
            scheduler = scheduler_of(made, 2, [40, 80], budget=16)  # 3 and 6 blocks
            made.begin_step(scheduler)
            # Ample for the step: 2 running (a block each), the step's token budget in blocks
            # (16 tokens: 1), both prompts with a block to spare each: 13; asked for with half
            # as much again (no limit), so the next steps need not count.
            assert made.credit.credit_bytes == (13 + 6) * PAGE
            assert handle.info().reserved_bytes == made.credit.credit_bytes
            free = made.get_num_free_blocks()
            assert free == 19
            taken = made.get_new_blocks(free)
            assert made.credit.credit_bytes == 0
            made.free_blocks(reversed(taken))
            ops = made.take_page_ops()  # the null block's page, then the 19
            assert ops is not None and ops.committed_pages == 20
            made.went_idle()  # credit and released pages go back to the device
            info = handle.info()
            assert (info.committed_bytes, info.reserved_bytes) == (PAGE, 0)
            made.begin_step(scheduler)
            ledger.set_limit("engine", 6 * PAGE)  # below what it holds: credit goes first
            made._next_limit_check = 0.0
            made.begin_step(scheduler)
            info = handle.info()
            assert info.used_bytes <= 6 * PAGE and info.committed_bytes == PAGE
            assert made.get_num_free_blocks() == 5  # the credit the limit leaves
        finally:
            made.close_elastic()
            handle.close()


def test_credit_short_of_the_ample_demand_is_topped_up_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credit that covers the running requests' exact demand but not the ample one is topped
    up to the ample demand and half as much again (one ledger operation), so the steps after
    it do not count the running requests again; under a limit that leaves room for the ample
    demand only, that is what is asked for."""
    # The pool judges an ask by the limit its last ledger operation read, while that view is
    # under LIMIT_VIEW_NS old (else it asks, and the ledger grants what the limit leaves): held
    # current here, so a slow machine cannot turn the local answer into the ledger's.
    monkeypatch.setattr("elastickv.control.ledger.LIMIT_VIEW_NS", 3600 * 10**9)
    with open_ledger(directory=str(tmp_path), total_bytes=256 * PAGE, utilization=1.0) as ledger:
        handle = ledger.register("engine")
        made = make_pool(64, None, policy=lambda config, device: CreditPolicy(handle))
        counted: list[int] = []
        running_blocks = made._running_blocks

        def counting(scheduler: Any) -> int:
            counted.append(1)
            return int(running_blocks(scheduler))

        made._running_blocks = counting
        try:
            # 4 running, one token each: exactly 4 blocks; ample: 4 and the step's 16 tokens
            # in blocks (1), so 5, asked for as 5 + 2.
            scheduler = scheduler_of(made, 4, [], budget=16)
            made.begin_step(scheduler)
            assert made.credit.credit_bytes == 7 * PAGE and len(counted) == 1
            made.get_new_blocks(3)  # 4 left: the exact demand, short of the ample one
            made.begin_step(scheduler)
            assert made.credit.credit_bytes == 7 * PAGE and len(counted) == 2
            for _ in range(3):
                made.begin_step(scheduler)  # ample: nothing counted, nothing asked
            assert made.credit.credit_bytes == 7 * PAGE and len(counted) == 2
        finally:
            made.close_elastic()
            handle.close()
        handle = ledger.register("limited")
        ledger.set_limit("limited", 7 * PAGE)  # the null block's page and 6: not 5 + 2
        made = make_pool(64, None, policy=lambda config, device: CreditPolicy(handle))
        try:
            made.begin_step(scheduler_of(made, 4, [], budget=16))
            assert made.credit is not None and made.credit.credit_bytes == 5 * PAGE
        finally:
            made.close_elastic()
            handle.close()


def record_asks(made: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The credit ``made`` asks the ledger for from now on, one entry per ``settle``."""
    asks: list[int] = []
    settle = made.credit.settle

    def counted_settle(credit: int) -> int:
        asks.append(credit)
        return int(settle(credit))

    monkeypatch.setattr(made.credit, "settle", counted_settle)
    return asks


def test_the_room_a_limit_leaves_is_taken_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting prompts whose blocks exceed what the limit leaves: the pool takes that room as
    credit on the first step (a prompt that fits it is admitted now), not after the retry
    interval (that waited up to 20 ms whenever the limit's last view was fresh); with no
    room left beyond its credit, it asks nothing."""
    monkeypatch.setattr("elastickv.control.ledger.LIMIT_VIEW_NS", 3600 * 10**9)
    with open_ledger(directory=str(tmp_path), total_bytes=256 * PAGE, utilization=1.0) as ledger:
        handle = ledger.register("limited")
        ledger.set_limit("limited", 6 * PAGE)  # the null block's page and 5
        made = make_pool(48, None, policy=credit_of(handle))
        try:
            scheduler = scheduler_of(made, 0, [80, 80], budget=16)  # 6 blocks each, room for 5
            made.begin_step(scheduler)
            assert made.credit.credit_bytes == 5 * PAGE
            assert made.get_num_free_blocks() == 5 and made._short
            asks = record_asks(made, monkeypatch)
            made._credit_retry_at = 0.0  # the retry falls due: nothing is left to ask for
            made.begin_step(scheduler)
            assert asks == [] and made.credit.credit_bytes == 5 * PAGE
        finally:
            made.close_elastic()
            handle.close()


def test_an_engine_holding_its_whole_limit_asks_the_ledger_again_only_when_it_may_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts wait beyond a limit whose room the credit already holds: the retries ask the
    ledger nothing while the limit last seen is under FULL_LIMIT_VIEW_NS old, though the
    20 ms view the rest of the credit path trusts has aged (each of them asked before); a
    limit raised meanwhile is taken at the next retry, and a view older than that asks."""
    import elastickv.integrations.vllm.scheduler.block_pool as block_pool

    monkeypatch.setattr("elastickv.control.ledger.LIMIT_VIEW_NS", 0)  # always aged
    monkeypatch.setattr(block_pool, "FULL_LIMIT_VIEW_NS", 3600 * 10**9)
    with open_ledger(directory=str(tmp_path), total_bytes=256 * PAGE, utilization=1.0) as ledger:
        handle = ledger.register("limited")
        ledger.set_limit("limited", 6 * PAGE)  # the null block's page and 5
        made = make_pool(48, None, policy=credit_of(handle))
        try:
            scheduler = scheduler_of(made, 0, [80, 80], budget=16)  # 6 blocks each
            made.begin_step(scheduler)
            assert made.credit.credit_bytes == 5 * PAGE and made._short
            asks = record_asks(made, monkeypatch)

            def retry() -> None:
                made._credit_retry_at = made._short_until = 0.0  # the retry falls due
                made.begin_step(scheduler)

            for _ in range(3):
                retry()
            assert asks == [] and made.credit.credit_bytes == 5 * PAGE
            ledger.set_limit("limited", 8 * PAGE)  # raised: a new revision
            retry()
            assert len(asks) == 1 and made.credit.credit_bytes == 7 * PAGE
            retry()
            assert len(asks) == 1  # all of the new limit held
            monkeypatch.setattr(block_pool, "FULL_LIMIT_VIEW_NS", 0)
            retry()
            assert len(asks) == 2 and made.credit.credit_bytes == 7 * PAGE
        finally:
            made.close_elastic()
            handle.close()


def test_blocks_freed_after_the_last_step_go_back_when_the_engine_idles(tmp_path: Path) -> None:
    """The blocks freed while a step's output is processed wait in a batch for the next step;
    when none comes (the engine's last request finished), going idle hands them over: their
    pages and the credit go back to the device."""
    with open_ledger(directory=str(tmp_path), total_bytes=64 * PAGE, utilization=1.0) as ledger:
        handle = ledger.register("engine")
        made = make_pool(32, None, policy=lambda config, device: CreditPolicy(handle))
        try:
            scheduler = scheduler_of(made, 1, [40])
            made.begin_step(scheduler)
            taken = made.get_new_blocks(4)
            made.end_step(scheduler, SimpleNamespace())
            live = made.allocator.stats().live_blocks
            made.free_blocks(reversed(taken))  # the step's request finished
            assert made.allocator.stats().live_blocks == live  # batched until the next step
            made.went_idle()
            assert made.allocator.stats().live_blocks == live - 4
            info = handle.info()
            assert (info.committed_bytes, info.reserved_bytes) == (PAGE, 0)
        finally:
            made.close_elastic()
            handle.close()


def test_admission_keeps_headroom_while_the_credit_binds(tmp_path: Path) -> None:
    """While the credit is what bounds the free count and requests wait, vLLM's watermark
    holds one block for every running request whose next token needs a new block, so a limit
    that holds exactly N prompts does not admit N that cannot grow; vLLM's own watermark is
    kept under it."""
    from elastickv.integrations.vllm.scheduler.block_pool import block_holders, headroom_and_slack

    made = make_pool(32, 6)  # null + 5 pages
    try:
        running = made.get_new_blocks(2)
        holders = {"a": running[:1], "b": running[1:], "c": [], "d": running[:1]}
        requests = [  # "d" holds blocks and is not running (a transfer's): no headroom for it
            SimpleNamespace(request_id="a", num_tokens=16, num_computed_tokens=15),  # grows
            SimpleNamespace(request_id="b", num_tokens=8, num_computed_tokens=7),  # mid-block
            SimpleNamespace(request_id="e", num_tokens=1, num_computed_tokens=0),  # no blocks
        ]
        manager = SimpleNamespace(
            watermark_blocks=1,  # vLLM's own (--watermark)
            coordinator=SimpleNamespace(
                single_type_managers=[SimpleNamespace(req_to_blocks=holders, block_size=16)]
            ),
        )
        scheduler = scheduler_of(made, 2, [16])
        scheduler.kv_cache_manager = manager
        scheduler.running = requests
        made.begin_step(scheduler)
        assert made.get_num_free_blocks() == 3  # the budget binds, not vLLM's 29 free
        assert manager.watermark_blocks == 1 + 1  # "a" needs a block next
        assert block_holders(manager) == (holders, 16)
        assert headroom_and_slack(holders, 16, requests) == (1, 8)  # "b" has 8 tokens left
        assert block_holders(SimpleNamespace()) is None  # internals not as expected: none
        roomy = make_pool(32, None)
        try:
            roomy_manager = SimpleNamespace(watermark_blocks=0, coordinator=manager.coordinator)
            scheduler.kv_cache_manager = roomy_manager
            roomy.begin_step(scheduler)
            assert roomy_manager.watermark_blocks == 0  # vLLM's own blocks bind: native
        finally:
            roomy.close_elastic()
    finally:
        made.close_elastic()


def test_a_steps_page_operations_map_exactly_what_was_granted() -> None:
    """The operations ``end_step`` hands to a step's output, applied by a worker's follower
    to a real host range, leave the worker holding exactly the granted pages, blocks freed in
    the step's output go with the next step, and the engine going idle sends the rest."""
    made = make_pool(32, 12, blocks_per_page=2)
    geometry = geometry_of(32, 2)
    with HostBackend(PAGE).reserve(geometry.backing_bytes) as vrange:
        follower = GrantFollower(vrange)
        try:
            scheduler = scheduler_of(made, 0, [])
            for step in range(6):
                made.begin_step(scheduler)
                taken = made.get_new_blocks(5 + step)
                output = SimpleNamespace()
                made.end_step(scheduler, output)
                follower.apply(output.elastickv_page_ops)
                assert vrange.footprint_bytes() == made.elastic_stats()["granted_pages"] * PAGE
                assert vrange.committed_pages() == made.allocator.committed_pages()
                made.free_blocks(reversed(taken))  # batched: handed over by the next step
            follower.apply(made.take_page_ops())
            assert vrange.committed_pages() == made.allocator.committed_pages()
            assert vrange.committed_pages() == made.allocator.null_block_pages()
        finally:
            made.close_elastic()


QUEUE_CHANGES = st.lists(
    st.tuples(
        st.sampled_from(["add", "admit", "preempt", "abort", "none"]),
        st.integers(1, 200),  # a new request's tokens
        st.integers(0, 7),  # which request an abort takes; how many run
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(changes=QUEUE_CHANGES)
def test_the_waiting_demand_follows_every_change_of_the_queue(
    changes: list[tuple[str, int, int]],
) -> None:
    """The demand a step forecasts (running requests plus the blocks of the prompts there
    is room to admit, a block to spare each, at most vLLM's free blocks) is kept between
    steps while the queue stays as it was; every change a step can see (a request added,
    admitted, preempted back to the front or aborted, fewer or more running) is followed."""
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    made = make_pool(32, None)
    try:
        scheduler = scheduler_of(made, 0, [], max_running=4)
        queue = scheduler.waiting = FCFSRequestQueue()  # vLLM's own (a deque)
        size = made._block_tokens
        made.begin_step(scheduler)
        for step, (change, tokens, which) in enumerate(changes):
            if change == "add":
                queue.add_request(waiting_request(f"r{step}", tokens))
            elif change == "admit" and queue:
                scheduler.running = [*scheduler.running, queue.pop_request()]
            elif change == "preempt" and scheduler.running:
                queue.prepend_request(scheduler.running.pop())
            elif change == "abort" and queue:
                queue.remove_request(list(queue)[which % len(queue)])
            elif change == "none":
                scheduler.running = scheduler.running[: which % 5]
            made.begin_step(scheduler)
            made.end_step(scheduler, SimpleNamespace())
            room = 4 - len(scheduler.running)
            prompts = sum(-(-r.num_tokens // size) + 1 for r in list(queue)[: max(room, 0)])
            want = 0
            if queue:
                free = made.free_block_queue.num_free_blocks
                want = len(scheduler.running) + (min(prompts, free) if room > 0 else 0)
            assert made.allocator.forecast_blocks == want
    finally:
        made.close_elastic()


def credit_of(handle: Any) -> PolicyFactory:
    """A pool policy: credit in ``handle``'s ledger record."""

    def policy(config: ElasticConfig, device: str) -> CreditPolicy:
        return CreditPolicy(handle)

    return policy


def apply_change(
    change: str,
    step: int,
    tokens: int,
    amount: int,
    made: Any,
    scheduler: Any,
    table: dict[str, list[Any]],
) -> None:
    """One change between two steps of the differential tests below, on ``made``'s
    scheduler (up to 4 running) and ``table``, each running request's blocks by id."""
    queue, running = scheduler.waiting, scheduler.running
    if change == "add":
        queue.add_request(waiting_request(f"r{step}", tokens))
    elif change == "admit" and queue and len(running) < 4:
        admitted = queue.pop_request()
        scheduler.running = [*running, admitted]
        table[admitted.request_id] = []
    elif change in ("preempt", "finish") and running:
        index = len(running) - 1 if change == "preempt" else amount % len(running)
        gone = running[index]
        scheduler.running = [r for i, r in enumerate(running) if i != index]
        made.free_blocks(reversed(table.pop(gone.request_id)))
        if change == "preempt":
            queue.prepend_request(gone)
    elif change == "leave" and running:  # its blocks still another request's: none freed
        scheduler.running = running[:-1]
        del table[running[-1].request_id]
    elif change == "swap" and queue:  # the first one aborted, another added
        queue.remove_request(queue.peek_request())
        queue.add_request(waiting_request(f"s{step}", tokens))
    elif change == "grow" and running and amount <= made.get_num_free_blocks():
        table[running[-1].request_id].extend(made.get_new_blocks(amount))
    elif change == "decode":
        for request in running:
            request.num_tokens += amount


STEADY_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "admit", "preempt", "finish", "grow", "swap", "none"]),
        st.integers(1, 120),  # a new request's tokens
        st.integers(0, 3),  # blocks a running request grows by; which request finishes
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(steps=STEADY_STEPS)
# One request takes more blocks between two steps than its credit's top-up held, the counts
# unchanged: only the allocator's state version tells the next step it is not steady.
@example(steps=[("add", 10, 0), ("admit", 1, 0), ("none", 1, 0), ("grow", 1, 6), ("none", 1, 0)])
def test_a_steady_step_decides_as_a_counted_one(
    steps: list[tuple[str, int, int]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A step that begins from the state the last one left (same allocator state, credit,
    parked blocks, running and waiting counts, first waiting request) keeps that step's
    decision instead of counting again: two pools driven alike, one made to count every
    step, hold the same credit, forecast and free-block count after every step (a waiting
    request aborted and another added between two steps included)."""
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    import elastickv.integrations.vllm.scheduler.block_pool as block_pool

    folder = tmp_path_factory.mktemp("ledger")
    with (
        pytest.MonkeyPatch.context() as patch,
        open_ledger(directory=str(folder), total_bytes=256 * PAGE, utilization=1.0) as ledger,
    ):
        # No limit check or publication falls due between the two pools' steps.
        patch.setattr(block_pool, "LIMIT_CHECK_INTERVAL_S", 3600.0)
        patch.setattr(block_pool, "PUBLISH_INTERVAL_S", 3600.0)
        handles = [ledger.register("steady"), ledger.register("counted")]
        pools = [make_pool(48, None, hot_max_pages=2, policy=credit_of(h)) for h in handles]
        steady, counted = pools
        tables: list[dict[str, list[Any]]] = [{}, {}]  # each running request's blocks
        schedulers = [scheduler_of(made, 0, [], max_running=4) for made in pools]
        for scheduler in schedulers:
            scheduler.waiting = FCFSRequestQueue()
        try:
            for step, (change, tokens, amount) in enumerate(steps):
                for made, scheduler, table in zip(pools, schedulers, tables, strict=True):
                    apply_change(change, step, tokens, amount, made, scheduler, table)
                    counted._steady_version = -1  # this one counts every step
                    made.begin_step(scheduler)
                    made.end_step(scheduler, SimpleNamespace())
                    made.take_page_ops()
                assert steady.credit.credit_bytes == counted.credit.credit_bytes
                assert steady.allocator.forecast_blocks == counted.allocator.forecast_blocks
                assert steady.get_num_free_blocks() == counted.get_num_free_blocks()
                assert steady._short == counted._short
        finally:
            for made in pools:
                made.close_elastic()
            for handle in handles:
                handle.close()


def manager_with(holders: dict[str, list[Any]]) -> Any:
    """vLLM's KV-cache manager as the pool reads it: its watermark and, for the admission
    headroom, the blocks of each request (block size 16)."""
    single = SimpleNamespace(req_to_blocks=holders, block_size=16)
    return SimpleNamespace(
        watermark_blocks=0, coordinator=SimpleNamespace(single_type_managers=[single])
    )


SHORT_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "admit", "preempt", "finish", "leave", "grow", "decode", "none"]),
        st.integers(1, 80),  # a new request's tokens
        st.integers(0, 16),  # blocks a running request grows by, or tokens each decodes
    ),
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(steps=SHORT_STEPS, spec=st.integers(0, 3))
# The running request (2 full blocks) takes a third, then decodes 4 tokens a step with 3
# speculative tokens: it needs a fourth block 4 steps later, not 16.
@example(steps=[("grow", 0, 1), *[("decode", 0, 4)] * 4, ("none", 0, 0)], spec=3)
# It leaves running with its blocks still held (shared with another request): no block
# moves, and the headroom it took goes; then also with another admitted in its place.
@example(steps=[("leave", 0, 0), ("none", 0, 0)], spec=0)
@example(steps=[("admit", 1, 0), ("preempt", 1, 0), ("leave", 1, 0), ("admit", 1, 0)], spec=0)
def test_a_short_step_keeps_the_headroom_a_counted_one_would(
    steps: list[tuple[str, int, int]], spec: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An engine short of credit within the retry interval only keeps the admission headroom
    on its steps, and counts it again only when a running request may have filled its blocks
    since the last count: two pools under the same limit driven alike (requests added,
    admitted, preempted and finished, blocks taken, up to 1 + ``spec`` tokens decoded a step
    with ``spec`` speculative tokens), one made to take the full path and count every step,
    set the same watermark and count the same refusals after every step."""
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    import elastickv.integrations.vllm.scheduler.block_pool as block_pool

    folder = tmp_path_factory.mktemp("ledger")
    counts: list[int] = [0, 0]  # counts taken by each pool, told apart by their tables
    count_for = block_pool.headroom_and_slack

    def counting(holders: dict[str, list[Any]], size: int, running: Any) -> tuple[int, int]:
        counts[holders is tables[1]] += 1
        return count_for(holders, size, running)

    with (
        pytest.MonkeyPatch.context() as patch,
        open_ledger(directory=str(folder), total_bytes=256 * PAGE, utilization=1.0) as ledger,
    ):
        # No retry, limit check or publication falls due between the two pools' steps, and
        # the limit each saw stays current (else a slow step sends one, not the other, to
        # the ledger, which then grants it another credit).
        for name in ("CREDIT_RETRY_S", "LIMIT_CHECK_INTERVAL_S", "PUBLISH_INTERVAL_S"):
            patch.setattr(block_pool, name, 3600.0)
        patch.setattr("elastickv.control.ledger.LIMIT_VIEW_NS", 3600 * 10**9)
        patch.setattr(block_pool, "headroom_and_slack", counting)
        handles = [ledger.register("short"), ledger.register("counted")]
        for handle in handles:
            ledger.set_limit(handle.name, 6 * PAGE)  # the null block's page and 5 blocks
        pools = [make_pool(48, None, policy=credit_of(h)) for h in handles]
        short, counted = pools
        tables: list[dict[str, list[Any]]] = [{}, {}]
        schedulers = [scheduler_of(made, 0, [], max_running=4, budget=16) for made in pools]
        for scheduler, table in zip(schedulers, tables, strict=True):
            scheduler.waiting = FCFSRequestQueue()
            scheduler.kv_cache_manager = manager_with(table)
            scheduler.num_spec_tokens = spec
        fast = 0
        headrooms: list[int] = []
        # Every example starts at the limit: one request running on two full blocks (its next
        # token needs a third), two waiting.
        start = [("add", 32, 0), ("admit", 0, 0), ("grow", 0, 2), ("add", 70, 0), ("add", 20, 0)]
        try:
            for step, (change, tokens, amount) in enumerate([*start, *steps]):
                if change == "decode":
                    amount = min(amount, 1 + spec)  # a step's tokens: one and the accepted
                for made, scheduler, table in zip(pools, schedulers, tables, strict=True):
                    apply_change(change, step, tokens, amount, made, scheduler, table)
                    if made is counted:
                        made._short_until = 0.0  # this one takes the full path every step
                        made._holding_until = -1  # and counts the headroom every step
                    elif made._short and time.monotonic() < made._short_until:
                        fast += 1
                    made.begin_step(scheduler)
                    made.end_step(scheduler, SimpleNamespace())
                    made.take_page_ops()
                watermarks = [s.kv_cache_manager.watermark_blocks for s in schedulers]
                assert watermarks[0] == watermarks[1]
                headrooms.append(watermarks[0])
                assert short.refusals == counted.refusals
                assert short._short == counted._short
                assert short.credit.credit_bytes == counted.credit.credit_bytes
                assert short.get_num_free_blocks() == counted.get_num_free_blocks()
            event(f"steps on the short path: {min(fast, 3)}+")
            event(f"largest headroom: {max(headrooms)}")
            event(f"counts kept: {min(counts[1] - counts[0], 3)}+")
        finally:
            for made in pools:
                made.close_elastic()
            for handle in handles:
                handle.close()


BENCH_SCHEDULER = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_scheduler.py"


def test_vllms_own_scheduler_at_the_limit_gets_the_headroom_a_count_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32's real ``Scheduler`` (built as ``bench_scheduler.py`` builds it: the tiny
    model's config, elastickv's hooks, a real ledger) at a limit of 512 KiB with 8 running:
    on every step short of credit, the admission headroom the pool keeps equals a fresh
    count over the running requests, though most steps keep the last count. What vLLM does
    between two steps (a token per running request, blocks taken, preemptions, finished
    requests) is what the kept count's rules assume."""
    import importlib.util

    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.sched import scheduler as vllm_scheduler

    import elastickv.integrations.vllm.scheduler.block_pool as block_pool

    spec = importlib.util.spec_from_file_location("bench_scheduler_under_test", BENCH_SCHEDULER)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # The hooks the benchmark installs go when the test ends.
    monkeypatch.setattr(kv_cache_coordinator, "BlockPool", kv_cache_coordinator.BlockPool)
    for name in ("schedule", "shutdown"):
        monkeypatch.setattr(vllm_scheduler.Scheduler, name, getattr(vllm_scheduler.Scheduler, name))
    budget = 512 << 10
    for key, value in {
        "ELASTICKV": "1",
        "ELASTICKV_VIRTUAL_CAPACITY": str(bench.KV_CACHE_BYTES),
        "ELASTICKV_BUDGET": str(budget),
        "ELASTICKV_PAGE_SIZE": str(bench.LIMIT_PAGE_BYTES),
        "ELASTICKV_LEDGER_DIR": str(tmp_path),
    }.items():
        monkeypatch.setenv(key, value)
    args = SimpleNamespace(
        model="tiny-llama", requests=48, concurrency=8, max_tokens=64,
        kv_cache_bytes=bench.KV_CACHE_BYTES, budget=budget,
    )  # fmt: skip
    scheduler = bench.build_scheduler(args, True)
    made = scheduler.kv_cache_manager.block_pool
    assert isinstance(made, block_pool.ElasticBlockPool)
    keep = block_pool.ElasticBlockPool._keep_headroom
    count_for = block_pool.headroom_and_slack
    checked: list[int] = []  # the headroom of each step short of credit
    counts: list[int] = []  # the pool's own counts

    def keep_and_check(pool: Any, scheduler: Any) -> int:
        headroom: int = keep(pool, scheduler)
        holders, size = pool._holders
        assert headroom == count_for(holders, size, scheduler.running)[0]
        checked.append(headroom)
        return headroom

    def counting(holders: dict[str, list[Any]], size: int, running: Any) -> tuple[int, int]:
        counts.append(1)
        return count_for(holders, size, running)

    monkeypatch.setattr(block_pool.ElasticBlockPool, "_keep_headroom", keep_and_check)
    monkeypatch.setattr(block_pool, "headroom_and_slack", counting)
    try:
        found = bench.run_pass(scheduler, bench.prompt_token_ids(args.requests, bench.VOCAB), args)
    finally:
        scheduler.shutdown()
    assert found["preempted"] > 0  # the limit binds
    assert max(checked) > 0  # a running request needed a block while others waited
    assert len(counts) < len(checked) // 2, (len(counts), len(checked))  # most steps keep it


def test_pages_freed_while_requests_wait_stay_hot_until_the_queue_empties() -> None:
    """An engine with requests waiting keeps the pages a finished request frees (the next
    step takes them again) instead of releasing them and committing them again; once
    nobody waits, or the engine idles, they go back."""
    made = make_pool(32, 8)
    try:
        for demand_gone in ("the queue empties", "the engine idles"):
            finished = allocate(made, 4, [])
            assert finished is not None
            scheduler = scheduler_of(made, 1, [64], budget=16)
            made.begin_step(scheduler)
            made.end_step(scheduler, SimpleNamespace())  # 1 running + a 4-block prompt (+1)
            assert made.allocator.hot_reserve_cap == 6
            committed = made.elastic_stats()["pages_committed"]
            made.free_blocks(finished)
            assert made.elastic_stats()["hot_pages"] == 4
            admitted = allocate(made, 4, [])
            assert admitted is not None
            assert made.elastic_stats()["pages_committed"] == committed  # nothing committed
            made.free_blocks(admitted)
            if demand_gone == "the queue empties":
                empty = scheduler_of(made, 0, [])
                made.begin_step(empty)
                made.end_step(empty, SimpleNamespace())
            else:
                made.went_idle()
            assert made.elastic_stats()["hot_pages"] == 0  # hot_max_pages=0 again
            assert made.allocator.forecast_blocks == 0
    finally:
        made.close_elastic()


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_elastic_pool_keeps_vllms_books_like_vllms_pool(seed: int, caching: bool) -> None:
    """Random allocations, growth and frees (reversed per request, as the scheduler issues
    them; batched between two steps or one by one) on the elastic pool and on vLLM's own:
    the same free count and reference counts after every step, every block in use or parked
    is live in the allocator and every other block is free there, and reused blocks lose
    their hash."""
    import random

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool

    geometry = geometry_of(48)
    config = ElasticConfig(page_size=PAGE, hot_max_pages=2)
    store = ElasticStore.for_workers(
        config, geometry, geometry.backing_bytes, 1, "host", local_policy
    )
    REGISTRY.publish(store)
    elastic = ElasticBlockPool(48, caching, 16)
    native = BlockPool(48, caching, 16)
    rng = random.Random(seed)
    held: list[tuple[list[Any], list[Any]]] = []  # (elastic blocks, native blocks) per request
    hashes = 0
    try:
        for _ in range(300):
            roll = rng.random()
            free_now = native.get_num_free_blocks()
            if roll < 0.4 and free_now >= 4:
                n = rng.randint(1, 4)
                got = allocate(elastic, n, [])
                assert got is not None and len(got) == n
                held.append((got, native.get_new_blocks(n)))
            elif roll < 0.6 and held and free_now >= 1:
                mine, theirs = rng.choice(held)
                got = allocate(elastic, 1, [])
                assert got is not None
                mine.extend(got)
                theirs.extend(native.get_new_blocks(1))
            elif held:
                batch = rng.random() < 0.5
                if batch:  # a step ended: the frees until the next one are batched
                    elastic.end_step(None, SimpleNamespace())
                for _ in range(min(len(held), rng.randint(1, 3))):
                    mine, theirs = held.pop(rng.randrange(len(held)))
                    if caching:  # full blocks enter the prefix cache: they are parked
                        for block in mine[: rng.randint(0, len(mine))]:
                            hashes += 1
                            key = make_block_hash_with_group_id(
                                BlockHash(hashes.to_bytes(32, "big")), 0
                            )
                            elastic._insert_block_hash(key, block, num_tokens=16)
                    elastic.free_blocks(reversed(mine))
                    native.free_blocks(reversed(theirs))
                if batch:  # the next step hands them over
                    elastic.begin_step(scheduler_of(elastic, 0, []))
            allocator = elastic.allocator
            assert elastic.get_num_free_blocks() == native.get_num_free_blocks()
            assert elastic.get_usage() == native.get_usage()
            assert sorted(b.ref_cnt for b in elastic.blocks) == sorted(
                b.ref_cnt for b in native.blocks
            )
            in_use = {b.block_id for b in elastic.blocks if b.ref_cnt > 0}
            parked = set(elastic._parked)
            assert allocator.live_blocks() == in_use | parked  # (the null block apart)
            assert all(b.block_hash is None for r, _ in held for b in r if b.block_id not in parked)
    finally:
        elastic.close_elastic()


def test_the_prefix_cache_resets_while_the_budget_binds() -> None:
    """vLLM's ``reset_prefix_cache`` (its ``/reset_prefix_cache`` endpoint, sleep level 1)
    succeeds only when no block is in use, and counts that from ``get_num_free_blocks``: an
    idle engine whose budget binds (fewer backable blocks than vLLM's free ones) must still
    reset, and drop its parked blocks' pages. (It answered False, with vLLM's "blocks are
    still in use" warning.)"""
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    made = make_pool(24, 4, hot_max_pages=0)
    try:
        blocks = made.get_new_blocks(2)
        for index, block in enumerate(blocks):
            key = make_block_hash_with_group_id(BlockHash(bytes([index + 1]) * 32), 0)
            made._insert_block_hash(key, block, num_tokens=16)
        made.free_blocks(reversed(blocks))
        assert made.elastic_stats()["parked_blocks"] == 2
        assert made.get_num_free_blocks() < made.free_block_queue.num_free_blocks
        assert made.reset_prefix_cache()
        stats = made.elastic_stats()
        assert stats["parked_blocks"] == 0 and stats["committed_pages"] == 1  # the null block's
        assert made.get_num_free_blocks() < made.free_block_queue.num_free_blocks
    finally:
        made.close_elastic()


def test_an_engine_waiting_for_memory_skips_its_empty_steps(tmp_path: Path) -> None:
    """Requests wait, none runs and the limit holds none of them: vLLM would step (and call
    every worker) a thousand times a second, each step empty. The pool says the next step
    would schedule nothing again, without asking the ledger more than every
    ``CREDIT_RETRY_S``, until a request arrives, a raised limit grants credit, or a request
    runs; an engine with a KV connector always steps (its transfers progress through
    steps)."""
    from elastickv.integrations.vllm.scheduler import block_pool

    with open_ledger(directory=str(tmp_path), total_bytes=64 * PAGE, utilization=1.0) as ledger:
        handle = ledger.register("engine", limit=3 * PAGE)  # the null block + 2 pages
        made = make_pool(32, None, policy=lambda config, device: CreditPolicy(handle))
        try:
            scheduler = scheduler_of(made, 0, [])
            scheduler.waiting = _Waiting([waiting_request("a", 80)])  # 6 blocks
            scheduler.requests = {"a": scheduler.waiting[0]}
            scheduler.connector = None
            scheduler.finished_req_ids = set()
            made.begin_step(scheduler)
            assert made.get_num_free_blocks() < 6  # vLLM schedules nothing
            made.note_step(scheduler, False)
            asked = handle.info().refusals
            began = time.monotonic()
            for _ in range(50):
                assert made.waits_for_memory(scheduler)
            # The ledger is asked at most once per retry interval, however often vLLM's loop
            # comes by.
            spell = time.monotonic() - began
            assert handle.info().refusals - asked <= 1 + spell / block_pool.CREDIT_RETRY_S
            # A new request ends the wait (vLLM may admit it, or the first one, now).
            scheduler.waiting.append(waiting_request("b", 16))
            scheduler.requests["b"] = scheduler.waiting[1]
            assert not made.waits_for_memory(scheduler)
            made.begin_step(scheduler)
            made.note_step(scheduler, False)
            assert made.waits_for_memory(scheduler)
            # A raised limit: the next question to the ledger gets credit, and the wait ends.
            ledger.set_limit("engine", 32 * PAGE)
            made._credit_retry_at = 0.0  # the retry interval passed
            assert not made.waits_for_memory(scheduler)
            made.begin_step(scheduler)
            assert made.get_num_free_blocks() >= 6
            # Nothing waits for memory while a request runs, after a step that scheduled
            # work, after a step that changed the state it began from (a preemption freed
            # blocks: vLLM admits nothing in that step, but may in the next), or with a KV
            # connector.
            ledger.set_limit("engine", 3 * PAGE)
            made._next_limit_check = 0.0
            made.begin_step(scheduler)
            made.note_step(scheduler, True)
            assert not made.waits_for_memory(scheduler)
            made.begin_step(scheduler)
            made.free_blocks(made.get_new_blocks(1))  # what a preemption does to the state
            made.note_step(scheduler, False)
            assert not made.waits_for_memory(scheduler)
            for running, connector in ((1, None), (0, object())):
                scheduler.running = scheduler_of(made, running, []).running
                scheduler.connector = connector
                made.begin_step(scheduler)
                made.note_step(scheduler, False)
                assert not made.waits_for_memory(scheduler), (running, connector)
        finally:
            made.close_elastic()
            handle.close()
