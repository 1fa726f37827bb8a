"""The memory arbiter: planning invariants (hypothesis) and, against a real ledger with
instances committing from threads, the budget holds whatever the interleaving."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.control import open_ledger
from elastickv.serve.arbiter import (
    Activity,
    Demand,
    LimitWriter,
    MemoryArbiter,
    ModelView,
    plan_limits,
)

MiB = 1 << 20
PAGE = 64 << 10


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Demand], int, int]:
    count = draw(st.integers(1, 5))
    demands = []
    for i in range(count):
        min_kv = draw(st.integers(1, 64)) * PAGE
        cap = min_kv + draw(st.integers(0, 256)) * PAGE
        activity = draw(st.sampled_from(list(Activity)))
        used = 0 if activity is Activity.DOWN else draw(st.integers(0, cap // PAGE)) * PAGE
        limit = (
            None
            if activity is Activity.DOWN
            else max(used, draw(st.integers(1, cap // PAGE)) * PAGE)
        )
        demands.append(
            Demand(
                f"m{i}", min_kv, cap, draw(st.integers(0, 2)), activity, used=used, limit=limit,
                pressured=draw(st.booleans()), floor=min(used, 2 * PAGE) if used else PAGE,
            )
        )  # fmt: skip
    floors = sum(max(d.min_kv, d.used) for d in demands)
    budget = floors + draw(st.integers(0, 512)) * PAGE
    return demands, budget, draw(st.integers(1, 16)) * PAGE


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_plan_keeps_the_budget_and_each_models_bounds(case: tuple[list[Demand], int, int]) -> None:
    demands, budget, step = case
    targets = plan_limits(demands, budget, step)
    by_name = {d.name: d for d in demands}
    assert set(targets) == {d.name for d in demands if d.activity is not Activity.DOWN}
    held = sum(max(targets.get(d.name, 0), d.min_kv, d.used) for d in demands)
    assert held <= budget
    for name, target in targets.items():
        d = by_name[name]
        if d.activity is Activity.RELEASED:
            assert target == max(1, d.floor)
        elif d.activity is Activity.IDLE:
            squeeze = any(o.activity is Activity.ACTIVE and o.pressured for o in demands)
            assert target == (d.min_kv if squeeze else min(d.cap, max(d.min_kv, d.used)))
        else:
            assert max(d.min_kv, d.used) <= target <= max(d.cap, d.min_kv, d.used)
    # Raises are applied in the plan's order: active models first, by priority.
    active = [n for n in targets if by_name[n].activity is Activity.ACTIVE]
    assert list(targets)[: len(active)] == active
    assert [by_name[n].priority for n in active] == sorted(
        (by_name[n].priority for n in active), reverse=True
    )


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_a_higher_priority_model_is_served_first(case: tuple[list[Demand], int, int]) -> None:
    demands, budget, step = case
    targets = plan_limits(demands, budget, step)
    active = [d for d in demands if d.activity is Activity.ACTIVE]
    for high in active:
        short = targets[high.name] < high.want(step)
        if not short:
            continue
        for low in active:
            if low.priority < high.priority:
                assert targets[low.name] == max(low.min_kv, low.used), (high, low)


def test_idle_shrinks_and_a_burst_grows() -> None:
    burst = Demand("a", 4 * MiB, 24 * MiB, 0, Activity.ACTIVE, used=6 * MiB, limit=8 * MiB,
                   pressured=True)  # fmt: skip
    idle = Demand("b", 4 * MiB, 24 * MiB, 0, Activity.IDLE, used=10 * MiB, limit=20 * MiB)
    released = Demand("c", 4 * MiB, 24 * MiB, 0, Activity.RELEASED, used=MiB, floor=MiB // 2)
    calm = plan_limits([replace(burst, pressured=False), idle, released], 32 * MiB, MiB)
    assert calm["b"] == 10 * MiB  # held to what it uses: its prefix cache stays
    targets = plan_limits([burst, idle, released], 32 * MiB, MiB)
    assert targets["b"] == 4 * MiB  # a burst is pressured: b gives back all but its min_kv
    assert targets["c"] == MiB // 2  # to its engine's floor
    # b's 10 MiB still count until b has released them; c's min_kv stays reserved.
    assert targets["a"] == 32 * MiB - 10 * MiB - 4 * MiB
    after = plan_limits([burst, replace(idle, used=4 * MiB), released], 32 * MiB, MiB)
    assert after["a"] == 24 * MiB  # the next look hands b's room to the burst (a's cap)


def test_writer_keeps_the_budget_under_concurrent_commits() -> None:
    """Three instances commit and release pages from threads while the writer applies random
    targets; the ledger never holds more than the budget for them, and every raise lands only
    into room that was free."""
    budget = 64 * PAGE
    names = {"x": 8 * PAGE, "y": 8 * PAGE, "z": 8 * PAGE}
    stop = threading.Event()
    errors: list[str] = []
    with open_ledger("host", total_bytes=1 << 40, utilization=1.0) as ledger:
        handles = {n: ledger.register(n, limit=floor) for n, floor in names.items()}
        writer = LimitWriter(ledger, budget, names)

        def engine(name: str, seed: int) -> None:
            rng = random.Random(seed)
            handle = handles[name]
            while not stop.is_set():
                if rng.random() < 0.6:
                    handle.try_admit(PAGE * rng.randint(1, 4))
                elif handle.committed_bytes:
                    handle.release(PAGE * min(rng.randint(1, 4), handle.committed_bytes // PAGE))

        def watch() -> None:
            while not stop.is_set():
                total = sum(i.used_bytes for i in ledger.list_instances())
                if total > budget:
                    errors.append(f"{total} > {budget}")

        threads = [threading.Thread(target=engine, args=(n, i)) for i, n in enumerate(names)]
        threads.append(threading.Thread(target=watch))
        for thread in threads:
            thread.start()
        rng = random.Random(7)
        raised = 0
        try:
            for _ in range(300):
                targets = {n: PAGE * rng.randint(1, 48) for n in names}
                raised += sum(
                    1 for c in writer.apply(targets) if c.old is not None and c.new > c.old
                )
                assert writer.held(writer.records()) <= budget
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        for handle in handles.values():
            handle.release(handle.committed_bytes)
            handle.close()
    assert not errors, errors[:3]
    assert raised > 0


def test_set_now_restores_the_reserved_floor_at_once() -> None:
    with open_ledger("host", total_bytes=1 << 40, utilization=1.0) as ledger:
        a = ledger.register("a", limit=4 * MiB)
        b = ledger.register("b", limit=4 * MiB)
        writer = LimitWriter(ledger, 12 * MiB, {"a": 4 * MiB, "b": 4 * MiB})
        writer.apply({"a": 8 * MiB})  # b's 4 MiB stay reserved
        assert writer.records()["a"].limit_desired == 8 * MiB
        writer.set_now("b", MiB)  # released
        assert writer.records()["b"].limit_desired == MiB
        writer.apply({"a": 12 * MiB})  # cannot take b's reservation
        assert writer.records()["a"].limit_desired == 8 * MiB
        change = writer.set_now("b", 4 * MiB)  # a wake: its min_kv, at once
        assert change is not None and writer.records()["b"].limit_desired == 4 * MiB
        assert writer.set_now("b", 12 * MiB) is None  # beyond the room: refused
        a.close()
        b.close()


def test_writer_never_sets_a_limit_below_an_engines_floor() -> None:
    """A release to a floor below what the engine holds for life (its null block) writes the
    engine's floor instead: the ledger would refuse the lower limit."""
    with open_ledger("host", total_bytes=1 << 40, utilization=1.0) as ledger:
        engine = ledger.register("a", limit=4 * MiB)
        engine.set_floor_bytes(2 * MiB)
        writer = LimitWriter(ledger, 12 * MiB, {"a": 4 * MiB})
        change = writer.set_now("a", 128 << 10)
        assert change is not None and change.new == 2 * MiB
        assert writer.records()["a"].limit_desired == 2 * MiB
        engine.close()


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.integers(1, 64))
def test_a_newcomer_that_does_not_fit_squeezes_the_idle_models(
    case: tuple[list[Demand], int, int], newcomer_pages: int
) -> None:
    """A model added at run time reserves its min_kv before its engine starts; when what the
    others hold leaves no room for it, every idle model is cut to its min_kv (what it holds
    beyond is cache it gives back), so that the room comes."""
    demands, budget, step = case
    newcomer = Demand("new", newcomer_pages * PAGE, newcomer_pages * PAGE, 0, Activity.DOWN)
    everyone = [*demands, newcomer]
    targets = plan_limits(everyone, budget, step)
    if sum(max(d.min_kv, d.used) for d in everyone) <= budget:
        return  # it fits: nothing to squeeze for it
    for d in demands:
        if d.activity is Activity.IDLE:
            assert targets[d.name] == d.min_kv
    assert "new" not in targets  # no engine yet: only its min_kv is reserved


def test_a_model_added_and_removed_at_run_time() -> None:
    """The arbiter reserves a newcomer's min_kv at once: the room left goes negative while an
    idle model holds more than the rest leaves; its limit is cut to its min_kv at the next look,
    and once it has given the bytes back the newcomer fits. Removed, its reservation
    returns."""
    with open_ledger("host", total_bytes=1 << 40, utilization=1.0) as ledger:
        idle = ledger.register("a", limit=12 * MiB)
        assert idle.try_admit(10 * MiB)
        views = [ModelView("a", 4 * MiB, 12 * MiB, 0, Activity.IDLE, 0)]
        arbiter = MemoryArbiter(ledger, 16 * MiB, views, lambda: views, PAGE)
        arbiter.look()
        assert arbiter.writer.records()["a"].limit_desired == 10 * MiB  # held to what it uses
        assert arbiter.room_left() == 16 * MiB - 10 * MiB
        views.append(ModelView("b", 8 * MiB, 8 * MiB, 0, Activity.DOWN, 0))
        arbiter.add(views[-1], PAGE)
        assert arbiter.room_left() == 16 * MiB - 10 * MiB - 8 * MiB  # short of 2 MiB
        arbiter.look()
        assert arbiter.writer.records()["a"].limit_desired == 4 * MiB  # squeezed
        assert arbiter.room_left() == 16 * MiB - 10 * MiB - 8 * MiB  # a still holds 10 MiB
        idle.release(6 * MiB)  # the engine drops its cache under the new limit
        assert arbiter.room_left() == 16 * MiB - 4 * MiB - 8 * MiB
        views.pop()
        arbiter.remove("b")
        assert arbiter.room_left() == 16 * MiB - 4 * MiB
        assert "b" not in arbiter.step and "b" not in arbiter.raises
        idle.release(idle.committed_bytes)
        idle.close()
