"""The elastic block pool against vLLM 0.32's own ``BlockPool`` machinery, driven the way
``KVCacheManager.allocate_slots`` drives it, without an engine: a prefix-cache hit on parked
blocks while the budget is full must never lose those blocks to eviction.

Before the fix, backing the new blocks evicted the hit blocks (they were the least recently
used parked ones), vLLM then took them back with ``touch`` while elastickv handed them out
again, and the engine died with "remove() called on an invalid block" (seen under
``elastickv serve`` with three models on a tight budget)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.store import REGISTRY, ElasticStore, local_policy
from elastickv.vmm import host_granularity

PAGE = host_granularity()


def make_pool(
    num_blocks: int,
    budget_pages: int,
    *,
    precommit: bool = False,
    blocks_per_page: int = 1,
    hot_max_pages: int = 0,
) -> Any:
    """An elastic pool of ``num_blocks`` blocks, ``blocks_per_page`` blocks per page (1 or
    2), ``budget_pages`` pages allowed (the null block takes one), ``hot_max_pages`` freed
    pages kept, with the pre-commit thread if ``precommit``."""
    from elastickv.integrations.vllm.block_pool import ElasticBlockPool

    # 1 layer, 1 KV head, 16 tokens of 2×(PAGE/128 or /256) fp32: a page's worth or half.
    geometry = KVCacheGeometry(
        num_layers=1, num_blocks=num_blocks, num_kv_heads=1, block_size=16,
        head_size=PAGE // (128 * blocks_per_page), dtype="float32", layout="HND",
    )  # fmt: skip
    assert geometry.backing_bytes * blocks_per_page == num_blocks * PAGE
    config = ElasticConfig(
        page_size=PAGE,
        budget_bytes=budget_pages * PAGE,
        hot_max_pages=hot_max_pages,
        precommit=precommit,
    )
    store = ElasticStore.create(config, geometry, geometry.backing_bytes, local_policy)
    REGISTRY.publish(store)
    return ElasticBlockPool(num_blocks, True, 16)


@pytest.fixture
def pool() -> Iterator[object]:
    made = make_pool(32, 5)
    yield made
    made.close_elastic()


def allocate(pool: object, num: int, hits: list[object], headroom: int = 0) -> list[object] | None:
    """What ``allocate_slots`` does: the fit check (after the coordinator told the pool the
    number and the prefix hits), then touch the hits and take the new blocks."""
    pool.open_window(headroom)  # type: ignore[attr-defined]
    try:
        pool.expect(num, (hits,))  # type: ignore[attr-defined]
        if pool.get_num_free_blocks() < num:  # type: ignore[attr-defined]
            return None
        pool.touch(hits)  # type: ignore[attr-defined]
        got: list[object] = pool.get_new_blocks(num)  # type: ignore[attr-defined]
        return got
    finally:
        pool.close_window()  # type: ignore[attr-defined]


def test_prefix_hits_are_not_evicted_to_back_new_blocks(pool: object) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    first = allocate(pool, 3, [])
    assert first is not None
    for i, block in enumerate(first):  # the request's full blocks enter the prefix cache
        key = make_block_hash_with_group_id(BlockHash(bytes([i + 1]) * 32), 0)
        pool._insert_block_hash(key, block, num_tokens=16)  # type: ignore[attr-defined]
    pool.free_blocks(reversed(first))  # type: ignore[attr-defined]
    assert pool.elastic_stats()["parked_blocks"] == 3  # type: ignore[attr-defined]
    # null block + 3 parked = 4 of 5 pages: the next request hits all 3 and needs 2 more.
    assert allocate(pool, 2, first) is None  # "cannot schedule now", not a crash
    stats = pool.elastic_stats()  # type: ignore[attr-defined]
    assert stats["parked_blocks"] == 3 and stats["live_blocks"] == 3  # (null block apart)
    assert all(b.block_hash is not None for b in first)  # type: ignore[attr-defined]
    # With one new block it fits; the hits are reused, the new block is another one.
    second = allocate(pool, 1, first)
    assert second is not None
    assert {b.block_id for b in second}.isdisjoint(b.block_id for b in first)  # type: ignore[attr-defined]
    assert all(b.ref_cnt == 1 for b in [*first, *second])  # type: ignore[attr-defined]
    assert pool.elastic_stats()["parked_blocks"] == 0  # type: ignore[attr-defined]


def test_a_refused_backing_asks_the_allocator_once(pool: object) -> None:
    """A request that cannot be backed (budget full, nothing parked to evict) is one refusal
    in the allocator's books, not two: the stash was empty, so the first answer stands until
    parked blocks were evicted."""
    assert allocate(pool, 4, []) is not None  # null block + 4 = the 5-page budget
    before = pool.allocator.stats().refusals  # type: ignore[attr-defined]
    assert allocate(pool, 1, []) is None
    assert pool.allocator.stats().refusals == before + 1  # type: ignore[attr-defined]
    assert pool.elastic_stats()["stash_blocks"] == 0  # type: ignore[attr-defined]


def test_a_step_without_new_blocks_leaves_the_allocator_alone(pool: object) -> None:
    """vLLM asks the pool for every running request in every step, most needing no new
    block: those calls must not reach the allocator (its lock and counters)."""
    assert allocate(pool, 2, []) is not None
    before = pool.allocator.stats()  # type: ignore[attr-defined]
    for _ in range(5):
        assert allocate(pool, 0, []) == []
    after = pool.allocator.stats()  # type: ignore[attr-defined]
    assert (after.allocations, after.refusals) == (before.allocations, before.refusals)


def test_admission_leaves_running_requests_room_to_grow(pool: object) -> None:
    """A waiting request is admitted only if the running ones can still take their next
    block (one each): otherwise a limit that holds exactly N prompts admits N, none can
    grow, and vLLM preempts and re-admits them in turn. A running request's own growth
    needs no headroom."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    from elastickv.integrations.vllm.block_pool import admission_headroom

    running = allocate(pool, 2, [])  # null block + 2 of the 5-page budget
    assert running is not None
    assert allocate(pool, 2, [], headroom=1) is None  # 5 of 5 pages: no room to grow
    assert pool.elastic_stats()["stash_blocks"] == 0  # type: ignore[attr-defined]
    admitted = allocate(pool, 1, [], headroom=1)  # 4 of 5: the running one can grow
    assert admitted is not None
    assert allocate(pool, 1, [], headroom=0) is not None  # a running request's growth
    # The headroom counts the other requests that hold blocks, only for admissions.
    holders = {"a": [object()], "b": [object()], "c": [], "new": []}
    manager = SimpleNamespace(
        coordinator=SimpleNamespace(single_type_managers=[SimpleNamespace(req_to_blocks=holders)])
    )
    waiting = SimpleNamespace(status=RequestStatus.WAITING, request_id="new")
    preempted = SimpleNamespace(status=RequestStatus.PREEMPTED, request_id="a")
    growing = SimpleNamespace(status=RequestStatus.RUNNING, request_id="a")
    assert admission_headroom(manager, waiting) == 2
    assert admission_headroom(manager, preempted) == 1
    assert admission_headroom(manager, growing) == 0
    assert admission_headroom(SimpleNamespace(), waiting) == 0


def test_admission_headroom_counts_holders_whose_next_token_needs_a_block() -> None:
    """With the scheduler's requests known, only holders that fill every block they hold
    count: one in the middle of a block takes no block in the next step (counting it too
    kept a binding limit's batches a block per running request short of native vLLM's)."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    from elastickv.integrations.vllm.block_pool import admission_headroom

    two = [object(), object()]
    holders = {"full": two, "middle": two, "gone": two, "idle": [], "new": []}
    requests = {
        "full": SimpleNamespace(num_tokens=32),  # 2 blocks of 16, both full: needs a third
        "middle": SimpleNamespace(num_tokens=20),  # room for 12 more tokens
        "idle": SimpleNamespace(num_tokens=0),
    }  # "gone" holds blocks but is unknown to the scheduler: counted, to be safe
    manager = SimpleNamespace(
        coordinator=SimpleNamespace(
            single_type_managers=[SimpleNamespace(req_to_blocks=holders, block_size=16)]
        ),
        block_pool=SimpleNamespace(tracked_requests=requests),
    )
    waiting = SimpleNamespace(status=RequestStatus.WAITING, request_id="new")
    assert admission_headroom(manager, waiting) == 2
    preempted = SimpleNamespace(status=RequestStatus.PREEMPTED, request_id="full")
    assert admission_headroom(manager, preempted) == 1


def test_admission_headroom_is_vllms_own_where_its_blocks_are_short() -> None:
    """Where vLLM's own free blocks run out before the limit does (no budget below the
    virtual size), admission is native vLLM's: a request that fits now is admitted, and vLLM
    preempts later if the running ones cannot grow. Before the cap, the headroom kept it
    queued (saturation bench: a quarter of native's preemptions and 1.57x its TTFT). Where
    the limit is shorter, the headroom still binds, up to what vLLM itself could give."""
    roomy = make_pool(8, 8)  # the whole virtual size is allowed
    try:
        assert allocate(roomy, 5, []) is not None  # null + 5 of 8: vLLM has 2 free
        assert roomy.get_num_free_blocks() == 2
        assert allocate(roomy, 2, [], headroom=1) is not None  # fits now, as in vLLM
    finally:
        roomy.close_elastic()
    tight = make_pool(8, 6)  # the limit binds before vLLM's 8 blocks do
    try:
        assert allocate(tight, 4, []) is not None  # null + 4 of 6 pages; vLLM has 3 free
        # 1 new block fits, but then vLLM would have 2 blocks free and the limit none.
        assert allocate(tight, 1, [], headroom=3) is None
        assert allocate(tight, 1, [], headroom=0) is not None  # growth needs no headroom
    finally:
        tight.close_elastic()


def test_forecast_demand_precommits_the_next_steps_blocks() -> None:
    """After a step is planned, the pool forecasts the next one (one block per running
    request, the blocks of the waiting requests there is room to admit) and the background
    thread commits them, so the allocation that follows commits nothing itself."""
    from types import SimpleNamespace

    made = make_pool(32, 8, precommit=True)
    try:

        def waiting(tokens: int) -> SimpleNamespace:
            return SimpleNamespace(num_tokens=tokens)

        running = allocate(made, 1, [])
        assert running is not None
        scheduler = SimpleNamespace(
            running=[object()],
            waiting=[waiting(20), waiting(40), waiting(16)],  # 2, 3 and 1 blocks of 16
            max_num_running_reqs=3,  # room for the first two
        )
        made.forecast_demand(scheduler)
        assert made.allocator.hot_reserve_cap == 6  # 1 + 2 + 3 blocks, one page each
        deadline = time.monotonic() + 10
        while made.elastic_stats()["pages_precommitted"] < 6:
            assert time.monotonic() < deadline, made.elastic_stats()
            time.sleep(0.01)
        committed = made.elastic_stats()["pages_committed"]
        assert allocate(made, 5, []) is not None
        assert made.elastic_stats()["pages_committed"] == committed  # nothing on the path
        scheduler.running, scheduler.waiting = [], []
        made.forecast_demand(scheduler)  # no demand: the unused page goes back
        while made.elastic_stats()["hot_pages"]:
            assert time.monotonic() < deadline, made.elastic_stats()
            time.sleep(0.01)
    finally:
        made.close_elastic()


def test_a_refusal_by_the_limit_stands_until_something_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine at its limit is refused the head of its queue on every step: the limit is
    not asked again for as many blocks or more while nothing here changed, but it is for
    fewer blocks, after a free, and once ``REFUSAL_RECHECK_S`` has passed."""
    from elastickv.integrations.vllm import block_pool

    made = make_pool(32, 5)
    try:
        held = allocate(made, 4, [])  # the null block's page + 4: the limit
        assert held is not None
        policy = made.allocator.policy
        asked: list[str] = []

        def counting(name: str) -> Any:
            original = getattr(policy, name)

            def counted(*args: Any) -> Any:
                asked.append(name)
                return original(*args)

            return counted

        for name in ("try_admit", "available_bytes"):
            monkeypatch.setattr(policy, name, counting(name))
        assert allocate(made, 2, []) is None and asked
        before = len(asked)
        assert allocate(made, 2, []) is None and allocate(made, 3, []) is None
        assert len(asked) == before  # the same refusal stands
        assert allocate(made, 1, []) is None and len(asked) > before  # fewer: asked again
        made.free_blocks(held[:1])  # its page goes back: room for one
        assert allocate(made, 1, []) is not None  # the free ended the refusal
        before = len(asked)
        assert allocate(made, 1, []) is None and allocate(made, 1, []) is None
        assert len(asked) == before  # back to the state it was refused in: it stands
        made.free_blocks(held[1:3])  # room for two: asked again
        assert allocate(made, 3, []) is None and len(asked) > before
        before = len(asked)
        assert allocate(made, 1, []) is not None  # the room shrank: the refusal of 3 stands
        assert allocate(made, 3, []) is None and allocate(made, 4, []) is None
        assert len(asked) == before + 1  # only the successful take asked
        assert allocate(made, 1, []) is not None  # at the limit again
        before = len(asked)
        monkeypatch.setattr(block_pool, "REFUSAL_RECHECK_S", 0.0)
        time.sleep(0.05)  # past the standing refusal's 0.02 s
        assert allocate(made, 1, []) is None and allocate(made, 1, []) is None
        assert len(asked) == before + 2  # each asked: a refusal now stands no time at all
        assert made.elastic_stats()["refusals"] == 5  # the allocator's: only those it saw
    finally:
        made.close_elastic()


# One step of the standing-refusal property test: take k blocks, free a held request's
# blocks (plain, or hashed so that they park in the prefix cache), or release the hot pages
# (what ``sync_limit`` does over a lowered limit); every step is followed by probes.
_REFUSAL_STEP = st.one_of(
    st.tuples(st.just("take"), st.integers(1, 3)),
    st.tuples(st.sampled_from(["free", "park"]), st.integers(0, 7)),
    st.tuples(st.just("trim"), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(_REFUSAL_STEP, min_size=1, max_size=30),
    blocks_per_page=st.sampled_from([1, 2]),
    hot_max_pages=st.sampled_from([0, 2]),
)
def test_a_standing_refusal_never_refuses_what_the_limit_would_admit(
    steps: list[tuple[str, int]], blocks_per_page: int, hot_max_pages: int
) -> None:
    """A refusal by the limit stands while the engine's room does not grow (fewer or as many
    warm, free and parked blocks, as many committed pages or more), also while blocks change
    hands: whenever the pool would refuse from a standing refusal, asking the limit for
    real refuses too. Probed (1 to 4 blocks) after every step of a random mix of takes,
    frees, frees into the prefix cache and hot-page releases at a limit of 5 pages, freed
    pages released at once or kept hot. (The free and committed counts each catch a page a
    free released; dropping the parked condition, or both of those, fails this test.)"""
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    from elastickv.integrations.vllm import block_pool

    saved = block_pool.REFUSAL_RECHECK_S
    block_pool.REFUSAL_RECHECK_S = 3600.0  # only the room may end a refusal here
    made = make_pool(16, 5, blocks_per_page=blocks_per_page, hot_max_pages=hot_max_pages)
    held: list[list[Any]] = []
    hashes = iter(range(1, 1 << 20))
    try:
        for action, number in steps:
            if action == "take":
                got = allocate(made, number, [])
                if got is not None:
                    held.append(got)
            elif action in ("free", "park") and held:
                blocks = held.pop(number % len(held))
                if action == "park":
                    for block in blocks:
                        key = make_block_hash_with_group_id(
                            BlockHash(next(hashes).to_bytes(32, "big")), 0
                        )
                        made._insert_block_hash(key, block, num_tokens=16)
                made.free_blocks(reversed(blocks))
            elif action == "trim":
                made.allocator.trim(0)
            for probe in range(1, 5):
                if not made._known_refusal(probe):
                    continue
                # The pool would refuse ``probe`` blocks without asking: ask for real.
                refusal = (made._refused_blocks, made._refused_until, made._refused_state)
                made._refused_blocks = 0
                got = allocate(made, probe, [])
                assert got is None, (action, number, probe, refusal, made.elastic_stats())
                made._refused_blocks, made._refused_until, made._refused_state = refusal
    finally:
        block_pool.REFUSAL_RECHECK_S = saved
        made.close_elastic()


def test_a_refused_admission_is_refused_again_without_counting_its_headroom(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine at its limit tries the head of its queue on every step. The headroom (a
    pass over every request holding blocks) is counted once for it: while that refusal
    stands, the same request is refused again without a count, another request is counted,
    and once a block changes hands the first one is counted again."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    from elastickv.integrations.vllm import block_pool

    counted: list[str] = []
    original = block_pool.admission_headroom

    def counting(manager: Any, request: Any) -> int:
        counted.append(request.request_id)
        return original(manager, request)

    monkeypatch.setattr(block_pool, "admission_headroom", counting)
    made = make_pool(32, 5)
    try:
        held = allocate(made, 2, [])  # the null block's page + 2 of 5
        assert held is not None
        holders = {"a": [object()], "b": [object()]}  # headroom 2 for any newcomer
        manager = SimpleNamespace(
            coordinator=SimpleNamespace(
                single_type_managers=[SimpleNamespace(req_to_blocks=holders)]
            )
        )

        def admit(request_id: str, num: int) -> list[object] | None:
            request = requests[request_id]
            made.open_admission(manager, request)
            try:
                made.expect(num, ([],))
                if made.get_num_free_blocks() < num:
                    return None
                got: list[object] = made.get_new_blocks(num)
                return got
            finally:
                made.close_window()

        requests = {
            name: SimpleNamespace(status=RequestStatus.WAITING, request_id=name)
            for name in ("w", "x")
        }
        assert admit("w", 1) is None  # 1 + 2 of headroom: past the 2 pages left
        assert admit("w", 1) is None and admit("w", 2) is None  # the refusal stands
        assert counted == ["w"]
        assert admit("x", 1) is None  # another request: counted
        assert admit("x", 1) is None
        assert counted == ["w", "x"]
        made.free_blocks(held[:1])  # a block changed hands: the refusal ends
        holders.pop("b")  # headroom 1: 1 + 1 fits in the 3 pages left
        assert admit("w", 1) is not None
        assert counted == ["w", "x", "w"]
        assert made.elastic_stats()["stash_blocks"] == 0
    finally:
        made.close_elastic()


def test_pages_freed_while_requests_wait_stay_hot_until_the_queue_empties() -> None:
    """Without pre-commit, an engine with requests waiting keeps the pages a finished request
    frees (the next step takes them again) instead of releasing them and committing them
    again; once nobody waits, or the engine idles, they go back."""
    from types import SimpleNamespace

    made = make_pool(32, 8)
    try:
        scheduler = SimpleNamespace(
            running=[object()], waiting=[SimpleNamespace(num_tokens=64)], max_num_running_reqs=4
        )
        for demand_gone in ("the queue empties", "the engine idles"):
            finished = allocate(made, 4, [])
            assert finished is not None
            scheduler.waiting = [SimpleNamespace(num_tokens=64)]
            made.forecast_demand(scheduler)  # 1 running + a 4-block prompt
            assert made.allocator.hot_reserve_cap == 5
            committed = made.elastic_stats()["pages_committed"]
            made.free_blocks(finished)
            assert made.elastic_stats()["hot_pages"] == 4
            admitted = allocate(made, 4, [])
            assert admitted is not None
            assert made.elastic_stats()["pages_committed"] == committed  # nothing committed
            made.free_blocks(admitted)
            if demand_gone == "the queue empties":
                scheduler.waiting = []
                made.forecast_demand(scheduler)
            else:
                made.idle_tick()
            assert made.elastic_stats()["hot_pages"] == 0  # hot_max_pages=0 again
            assert made.allocator.forecast_blocks == 0
    finally:
        made.close_elastic()


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_elastic_pool_keeps_vllms_books_like_vllms_pool(seed: int, caching: bool) -> None:
    """Random allocations, growth and frees (reversed per request, as the scheduler issues
    them; in batches or one by one) on the elastic pool and on vLLM's own: the same free
    count and reference counts after every step, every block in use or parked is live in the
    allocator and every other block is free there, and reused blocks lose their hash."""
    import random

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    from elastickv.integrations.vllm.block_pool import ElasticBlockPool

    geometry = KVCacheGeometry(
        num_layers=1, num_blocks=48, num_kv_heads=1, block_size=16, head_size=PAGE // 128,
        dtype="float32", layout="HND",
    )  # fmt: skip
    config = ElasticConfig(page_size=PAGE, hot_max_pages=2)
    store = ElasticStore.create(config, geometry, geometry.backing_bytes, local_policy)
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
                if batch:
                    elastic.begin_free_batch()
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
                if batch:
                    elastic.end_free_batch()
            allocator = elastic.allocator
            assert elastic.get_num_free_blocks() == native.get_num_free_blocks()
            assert sorted(b.ref_cnt for b in elastic.blocks) == sorted(
                b.ref_cnt for b in native.blocks
            )
            in_use = {b.block_id for b in elastic.blocks if b.ref_cnt > 0}
            parked = set(elastic._parked)
            assert allocator.live_blocks() == in_use | parked  # (the null block apart)
            assert all(b.block_hash is None for r, _ in held for b in r if b.block_id not in parked)
    finally:
        elastic.close_elastic()
