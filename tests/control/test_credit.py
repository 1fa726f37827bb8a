"""Credit in the ledger: taken ahead of demand, turned into committed pages locally, given
back; a lowered limit takes it back first; a dead engine's credit is reclaimed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.control import open_ledger
from elastickv.control.credit import CreditPolicy
from elastickv.control.ledger import Ledger

MiB = 1 << 20
PAGE = 64 << 10


def ledger_at(path: Path, budget: int) -> Ledger:
    return open_ledger(directory=str(path), total_bytes=budget, utilization=1.0)


def test_credit_is_taken_used_locally_and_given_back(tmp_path: Path) -> None:
    with ledger_at(tmp_path, 8 * MiB) as ledger, ledger.register("a") as handle:
        policy = CreditPolicy(handle)
        assert policy.settle(2 * MiB) == 2 * MiB
        info = handle.info()
        assert (info.committed_bytes, info.reserved_bytes) == (0, 2 * MiB)
        # Turning credit into committed pages is local: the record is unchanged until the
        # next settle, and the sum it holds covers what the engine holds.
        assert policy.try_admit(PAGE) and policy.try_admit(PAGE)
        assert (policy.admitted_bytes, policy.credit_bytes) == (2 * PAGE, 2 * MiB - 2 * PAGE)
        assert handle.info().used_bytes == 2 * MiB
        policy.release(PAGE)  # a released page is credit again
        assert policy.credit_bytes == 2 * MiB - PAGE
        assert policy.settle(0) == 0  # give it all back
        info = handle.info()
        assert (info.committed_bytes, info.reserved_bytes) == (PAGE, 0)
        # Short of credit, a commit asks the ledger (the null block at start-up).
        assert policy.try_admit(PAGE)
        assert handle.info().used_bytes == 2 * PAGE


def test_credit_is_granted_only_as_far_as_it_fits(tmp_path: Path) -> None:
    with (
        ledger_at(tmp_path, 4 * MiB) as ledger,
        ledger.register("a", limit=3 * MiB) as a,
        ledger.register("b") as b,
    ):
        first, second = CreditPolicy(a), CreditPolicy(b)
        assert first.settle(8 * MiB) == 3 * MiB  # its limit
        assert second.settle(8 * MiB) == 1 * MiB  # what the device budget has left
        assert not second.try_admit(2 * MiB)  # beyond its credit, and the ledger says no
        assert ledger.device_usage().used_bytes == 4 * MiB
        assert handle_refusals(ledger, "b") >= 1


def handle_refusals(ledger: Ledger, name: str) -> int:
    return next(i.refusals for i in ledger.list_instances() if i.name == name)


def test_a_lowered_limit_takes_credit_back_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import elastickv.control.ledger as ledger_module

    # The limit just read answers locally while that view is under LIMIT_VIEW_NS (20 ms)
    # old: fresh for the whole test, whatever a loaded machine stalls between two lines.
    monkeypatch.setattr(ledger_module, "LIMIT_VIEW_NS", 60 * 10**9)
    with ledger_at(tmp_path, 8 * MiB) as ledger, ledger.register("a") as handle:
        policy = CreditPolicy(handle)
        policy.settle(4 * MiB)
        assert policy.try_admit(MiB)
        ledger.set_limit("a", 2 * MiB)
        assert policy.over_limit_bytes() == 2 * MiB  # 1 MiB committed + 3 MiB credit - 2 MiB
        assert not policy.limit_allows(2 * MiB)  # answered from the limit just read
        assert policy.limit_room() == MiB  # 2 MiB less the 1 MiB committed
        assert policy.settle(4 * MiB) == MiB  # committed stays, credit shrinks to the limit
        assert policy.over_limit_bytes() == 0
        ledger.set_limit("a", MiB // 2)  # below what is committed: no credit at all
        assert policy.settle(MiB) == 0
        assert policy.limit_room() == 0
        assert policy.over_limit_bytes() == MiB // 2
        with pytest.raises(ValueError, match="holds only"):
            handle.settle(8 * MiB, 0)  # more committed than the record holds: a bug
        ledger.set_limit("a", None)
        assert policy.settle(0) == 0 and policy.limit_room() is None  # only the ledger can say
        monkeypatch.setattr(ledger_module, "LIMIT_VIEW_NS", 0)
        ledger.set_limit("a", 2 * MiB)
        assert policy.settle(0) == 0  # reads the new limit (and its revision)
        assert policy.limit_room() is None  # a view this old: only the ledger can say
        assert policy.limit_room(max_age_ns=60 * 10**9) == MiB  # trusted longer: 2 MiB - 1 MiB
        ledger.set_limit("a", 3 * MiB)
        assert policy.limit_room(max_age_ns=60 * 10**9) == 2 * MiB  # the limit set since


def test_a_dead_engines_credit_is_reclaimed(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from elastickv.control import open_ledger\n"
        "from elastickv.control.credit import CreditPolicy\n"
        "ledger = open_ledger(directory=sys.argv[1])\n"
        "policy = CreditPolicy(ledger.register('victim'))\n"
        "policy.settle(6 << 20)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    with ledger_at(tmp_path, 8 * MiB) as ledger:
        victim = subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
            with ledger.register("survivor") as handle:
                policy = CreditPolicy(handle)
                assert policy.settle(6 * MiB) == 2 * MiB
                victim.kill()
                victim.wait()
                assert policy.settle(6 * MiB) == 6 * MiB  # the dead record is swept first
        finally:
            victim.kill()
            victim.wait()


OPS = st.lists(
    st.tuples(st.sampled_from(["settle", "take", "release"]), st.integers(0, 48)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=25, deadline=None)
@given(st.lists(OPS, min_size=3, max_size=3), st.integers(4, 40))
def test_engines_committing_concurrently_never_exceed_the_budget(
    tmp_path_factory: pytest.TempPathFactory, scripts: list[list[tuple[str, int]]], pages: int
) -> None:
    """Three engines (threads, one record each) settle, take and release at random while a
    sampler reads the ledger: committed plus credit of all never exceeds the budget, and
    each record always holds at least what its engine committed."""
    budget = pages * PAGE
    with ledger_at(tmp_path_factory.mktemp("credit"), budget) as ledger:
        policies = [CreditPolicy(ledger.register(f"e{i}")) for i in range(3)]
        start = threading.Barrier(4)
        done = threading.Event()
        errors: list[BaseException] = []

        def engine(policy: CreditPolicy, script: list[tuple[str, int]]) -> None:
            try:
                start.wait()
                for op, n in script:
                    if op == "settle":
                        policy.settle(n * PAGE)
                    elif op == "take":
                        policy.try_admit(max(1, n // 8) * PAGE)
                    elif policy.admitted_bytes:
                        policy.release(min(policy.admitted_bytes, max(1, n // 8) * PAGE))
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [
            threading.Thread(target=engine, args=(policy, script))
            for policy, script in zip(policies, scripts, strict=True)
        ]
        for thread in threads:
            thread.start()
        start.wait()
        samples: list[int] = []
        while any(thread.is_alive() for thread in threads) or not samples:
            with ledger.frozen() as snap:
                samples.append(snap.usage.used_bytes)
                for info in snap.instances:
                    assert info.committed_bytes + info.reserved_bytes <= budget
        for thread in threads:
            thread.join()
        done.set()
        assert not errors, errors
        assert max(samples) <= budget
        for policy in policies:
            info = policy.info()
            assert policy.admitted_bytes + policy.credit_bytes == info.used_bytes
            policy.settle(0)
            policy.handle.close()
