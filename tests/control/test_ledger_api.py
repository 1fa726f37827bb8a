"""Registration, admission, the reserve, live limits and the Python API, in one process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from ledger_cases import BUDGET, MiB

from elastickv.alloc import BlockAllocator
from elastickv.control import (
    DuplicateInstance,
    InstanceClosed,
    Ledger,
    LedgerConfigMismatch,
    LedgerError,
    LedgerFull,
    LedgerPolicy,
    StaleRevision,
    UnknownInstance,
    cuda_device_key,
    device_usage,
    ledger_path,
    list_instances,
    open_ledger,
    parse_limit,
    set_limit,
    watch,
)
from elastickv.geometry import KVCacheGeometry
from elastickv.vmm import HostBackend

PAGE = 64 * 1024


def test_default_location_is_per_user_and_private(ledger: Ledger, ledger_dir: Path) -> None:
    assert ledger.path == str(ledger_dir / "host.ledger")
    assert ledger_path("host", "/x") == "/x/host.ledger"
    assert cuda_device_key("GPU-8F3A-01") == "cuda-gpu-8f3a-01"
    assert (ledger_dir / "host.ledger").stat().st_mode & 0o777 == 0o600
    assert ledger_dir.stat().st_mode & 0o777 == 0o700


def test_register_names_and_duplicates(ledger: Ledger) -> None:
    auto = ledger.register()
    assert auto.name.endswith(f"-{ledger.list_instances()[0].pid}")
    named = ledger.register("llama-a")
    with pytest.raises(DuplicateInstance, match="llama-a"):
        ledger.register("llama-a")
    with pytest.raises(ValueError, match="invalid instance name"):
        ledger.register("has space")
    assert sorted(i.name for i in ledger.list_instances()) == sorted([auto.name, "llama-a"])
    # A served model name with its organisation, and a P/D engine of `elastickv serve`.
    for served in ("meta-llama/Llama-3.1-8B", "chat/prefill"):
        ledger.register(served).close()
    named.close()
    named.close()
    assert [i.name for i in ledger.list_instances()] == [auto.name]
    ledger.register("llama-a").close()  # the name is free again
    with pytest.raises(InstanceClosed):
        named.try_admit(1)
    named.release(1)  # a no-op: the record and its bytes are gone


def test_capacity_full_is_a_clear_error(ledger_dir: Path) -> None:
    with open_ledger("cuda-gpu-test", total_bytes=BUDGET, capacity=2) as small:
        small.register("a")
        small.register("b")
        with pytest.raises(LedgerFull, match="full"):
            small.register("c")


def test_admission_respects_budget_and_counts(ledger: Ledger) -> None:
    a = ledger.register("a")
    b = ledger.register("b")
    assert a.try_admit(40 * MiB)
    assert not b.try_admit(30 * MiB)  # 70 > 64 MiB
    assert b.try_admit(24 * MiB)
    assert not a.try_admit(1)
    assert a.available_bytes() == 0
    b.release(4 * MiB)
    assert a.available_bytes() == 4 * MiB
    with pytest.raises(ValueError, match="holds only"):
        b.release(BUDGET)
    info = {i.name: i for i in ledger.list_instances()}
    assert info["a"].committed_bytes == 40 * MiB and info["a"].refusals == 1
    assert info["b"].admissions == 1 and info["b"].releases == 1
    usage = ledger.device_usage()
    assert usage.committed_bytes == 60 * MiB and usage.available_bytes == 4 * MiB
    assert usage.budget_bytes == BUDGET


def test_budget_is_total_times_utilization_minus_headroom(ledger_dir: Path) -> None:
    with open_ledger("cuda-x", total_bytes=100 * MiB, utilization=0.5, headroom_bytes=MiB) as led:
        assert led.device_usage().budget_bytes == 49 * MiB
        with pytest.raises(LedgerConfigMismatch, match="utilization"):
            open_ledger("cuda-x", utilization=0.9)
        with open_ledger("cuda-x") as joined:  # omitted budget: join whatever it is
            assert joined.device_usage().budget_bytes == 49 * MiB
        led.configure(utilization=1.0, headroom_bytes=0)
        assert led.device_usage().budget_bytes == 100 * MiB
    with pytest.raises(ValueError, match="total_bytes is required"):
        open_ledger("cuda-y")


def test_reserve_counts_in_use_and_is_consumed_first(ledger: Ledger) -> None:
    a = ledger.register("a")
    b = ledger.register("b")
    assert a.set_reserved_bytes(16 * MiB)
    assert not b.try_admit(50 * MiB)  # a's reserve is taken
    assert a.try_admit(10 * MiB)  # drawn from the reserve: no growth
    assert (a.committed_bytes, a.reserved_bytes) == (10 * MiB, 6 * MiB)
    assert ledger.device_usage().used_bytes == 16 * MiB
    assert not a.set_reserved_bytes(60 * MiB)
    assert a.set_reserved_bytes(0)
    assert b.try_admit(50 * MiB)


def test_limit_shrink_restore_regrow_with_revisions(ledger: Ledger) -> None:
    """kvcached #498: after a shrink and a restore, the instance must be able to grow again."""
    a = ledger.register("a", limit="32M")
    assert a.info().limit_revision == 1
    assert a.try_admit(24 * MiB)
    assert a.set_reserved_bytes(8 * MiB)
    assert not a.set_reserved_bytes(8 * MiB + 1)  # at the limit

    rev = ledger.set_limit("a", "16M", expected_revision=1)
    assert rev == 2
    info = a.info()
    # Only the owner gives back its reserve (credit it may already count on), then drains
    # its committed bytes; no growth meanwhile.
    assert info.reserved_bytes == 8 * MiB and a.reserved_bytes == 8 * MiB
    assert info.limit_desired == 16 * MiB
    assert info.limit_effective == 32 * MiB and info.draining
    assert info.over_limit_bytes == 16 * MiB
    assert not a.try_admit(8 * MiB + 1)
    assert a.set_reserved_bytes(0)
    info = a.info()
    assert info.limit_effective == 24 * MiB and info.over_limit_bytes == 8 * MiB
    assert not a.try_admit(1)
    a.release(12 * MiB)
    info = a.info()
    assert info.limit_effective == info.limit_desired == 16 * MiB and not info.draining
    assert a.try_admit(4 * MiB)
    assert not a.try_admit(1)

    with pytest.raises(StaleRevision, match="revision 2"):
        ledger.set_limit("a", "32M", expected_revision=1)
    assert ledger.set_limit("a", "32M", expected_revision=2) == 3
    assert a.try_admit(16 * MiB)  # growth is back
    assert a.info().committed_bytes == 32 * MiB
    assert ledger.set_limit("a", None) == 4
    assert a.try_admit(BUDGET - 32 * MiB)
    assert a.info().limit_effective == BUDGET
    assert ledger.set_limit("a", "50%") == 5
    assert a.info().limit_desired == BUDGET // 2
    with pytest.raises(UnknownInstance, match="nope"):
        ledger.set_limit("nope", 1)
    with pytest.raises(ValueError, match="invalid limit"):
        ledger.set_limit("a", "lots")


def test_parse_limit() -> None:
    assert parse_limit("30%", 1000) == 300
    assert parse_limit("12.5%", 1000) == 125
    assert parse_limit("2GiB", 1) == 2 << 30
    assert parse_limit("512M", 1) == 512 << 20
    assert parse_limit("none", 1) is None
    for bad in ("101%", "-1", "2X", "%", ""):
        with pytest.raises(ValueError, match="invalid limit"):
            parse_limit(bad, 1000)


def test_module_api_and_watch(ledger: Ledger) -> None:
    handle = ledger.register("svc")
    assert handle.try_admit(MiB)
    assert [i.name for i in list_instances()] == ["svc"]
    assert device_usage().committed_bytes == MiB
    revision = set_limit("svc", "2M")
    assert revision == 2
    stream = watch(0.01, changes_only=True)
    first = next(stream)
    assert first.instances[0].limit_desired == 2 * MiB
    handle.release(MiB)
    second = next(stream)
    assert second.usage.generation > first.usage.generation
    assert second.usage.committed_bytes == 0
    stream.close()


def test_ledger_is_thread_safe(ledger: Ledger) -> None:
    handles = [ledger.register(f"t{i}") for i in range(4)]
    errors: list[BaseException] = []

    def churn(index: int) -> None:
        try:
            handle = handles[index]
            for _ in range(500):
                if handle.try_admit(20 * MiB):
                    handle.release(20 * MiB)
                if index == 0:
                    assert ledger.device_usage().used_bytes <= BUDGET
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert ledger.device_usage().used_bytes == 0
    infos = ledger.list_instances()
    assert sum(i.admissions + i.refusals for i in infos) == 2000
    assert sum(i.admissions for i in infos) == sum(i.releases for i in infos)


def test_allocator_admits_pages_through_the_ledger(ledger_dir: Path) -> None:
    geometry = KVCacheGeometry(
        num_layers=2, num_blocks=512, num_kv_heads=2, block_size=16, head_size=64
    )
    budget = 2 * MiB
    with (
        open_ledger("cuda-alloc", total_bytes=budget, utilization=1.0) as led,
        led.register("engine") as handle,
        HostBackend(page_size=PAGE).reserve(geometry.backing_bytes) as vrange,
    ):
        policy = LedgerPolicy(handle)
        with BlockAllocator(geometry, vrange, policy) as alloc:
            got = []
            while (blocks := alloc.allocate(8)) is not None:
                got.append(blocks)
            assert vrange.footprint_bytes() == handle.committed_bytes == budget
            assert policy.admitted_bytes == budget
            assert not alloc.can_allocate(8)
            assert policy.info().refusals >= 1
            for blocks in got:
                alloc.free(blocks)
            assert handle.committed_bytes == vrange.footprint_bytes() == 2 * PAGE  # null block
            assert policy.set_reserved_bytes(4 * PAGE)
        assert handle.committed_bytes == 0
        assert led.device_usage().used_bytes == 4 * PAGE


def test_closed_ledger_and_fork_misuse_are_refused(ledger: Ledger) -> None:
    handle = ledger.register("x")
    pid = os.fork()
    if pid == 0:  # the child must open its own ledger, not reuse the parent's
        try:
            ledger.list_instances()
        except LedgerError as exc:
            os._exit(0 if "forked" in str(exc) else 1)
        os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [i.name for i in ledger.list_instances()] == ["x"]
    ledger.close()
    assert handle.closed
    with pytest.raises(LedgerError, match="closed"):
        ledger.register("y")


def test_limit_below_the_floor_is_refused_with_the_minimum(ledger: Ledger) -> None:
    """An instance that holds a floor for its whole life (a KV cache's null block) can never
    get under a lower limit: ``set_limit`` refuses it, naming the floor, and changes nothing;
    at or above the floor it applies."""
    from elastickv.control import LimitBelowFloor

    handle = ledger.register("engine")
    handle.set_floor_bytes(2 * MiB)
    assert handle.try_admit(2 * MiB)
    info = handle.info()
    assert info.floor_bytes == 2 * MiB
    with pytest.raises(LimitBelowFloor, match=r"below the floor of instance 'engine'.*2\.0 MiB"):
        ledger.set_limit("engine", "1M")
    after = handle.info()
    assert (after.limit_desired, after.limit_revision) == (info.limit_desired, info.limit_revision)
    assert ledger.set_limit("engine", "2M") == info.limit_revision + 1
    assert handle.info().limit_desired == 2 * MiB and not handle.info().draining


def test_growth_over_the_seen_limit_is_refused_without_the_ledger(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At its own limit, an instance is refused from the limit its last ledger operation read
    (no lock, no record written) while that view is fresh and the limit's revision unchanged;
    the record still counts those refusals, and a limit any process raises applies at once."""
    import elastickv.control.ledger as ledger_module

    monkeypatch.setattr(ledger_module, "LIMIT_VIEW_NS", 60 * 10**9)  # fresh for the test
    a = ledger.register("a", limit="16M")
    assert a.try_admit(16 * MiB)
    generation = ledger.snapshot().usage.generation
    assert not a.try_admit(MiB)
    assert not a.try_admit(MiB)
    assert ledger.snapshot().usage.generation == generation  # nothing was written
    assert a.info().refusals == 2  # counted once the owner reads its record
    assert not a.try_admit(MiB)
    a.release(MiB)
    assert a.try_admit(MiB)  # room under the limit: the ledger admits as before
    info = next(i for i in ledger.list_instances() if i.name == "a")
    assert (info.refusals, info.committed_bytes) == (3, 16 * MiB)
    # Another process raises the limit: the new revision sends the next call to the ledger.
    raise_limit = (
        "from elastickv.control import open_ledger\n"
        f"with open_ledger(total_bytes={BUDGET}, utilization=1.0, create=False) as other:\n"
        "    other.set_limit('a', '32M')\n"
    )
    subprocess.run([sys.executable, "-c", raise_limit], check=True, env=os.environ.copy())
    assert a.try_admit(MiB)
    # So does the owner's own ledger, and another ledger object in this process.
    assert a.try_admit(15 * MiB) and not a.try_admit(MiB)
    ledger.set_limit("a", "48M")
    assert a.try_admit(MiB)
    assert a.try_admit(15 * MiB) and not a.try_admit(MiB)
    set_limit("a", None)
    assert a.try_admit(MiB)
    # A stale view asks the ledger even when the revision is the same.
    ledger.set_limit("a", "48M")
    assert not a.try_admit(MiB)  # refused from the view the owner's set_limit refreshed
    generation = ledger.snapshot().usage.generation
    monkeypatch.setattr(ledger_module, "LIMIT_VIEW_NS", 0)
    assert not a.try_admit(MiB)
    assert ledger.snapshot().usage.generation != generation  # the ledger counted it


def test_over_limit_is_answered_from_the_seen_limit_until_it_changes(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine asks every 50 ms whether it is over its limit. While the record's limit
    revision is the one its last ledger operation read (and that view is under a second old),
    the answer comes from its own usage and that limit, without the ledger; it always equals
    what the ledger says, and a limit any process changes is seen at the next call."""
    import elastickv.control.ledger as ledger_module

    # Fresh for the test (the product's window is a second), whatever a loaded machine
    # stalls; its expiry is tested at the end.
    monkeypatch.setattr(ledger_module, "OVER_LIMIT_VIEW_NS", 60 * 10**9)
    a = ledger.register("a", limit="16M")
    assert a.try_admit(12 * MiB)
    reads: list[str] = []
    handle_info = ledger._handle_info

    def counted(handle: object) -> object:
        reads.append("info")
        return handle_info(handle)  # type: ignore[arg-type]

    monkeypatch.setattr(ledger, "_handle_info", counted)
    assert a.over_limit_bytes() == 0 and a.over_limit_bytes() == 0
    assert reads == []  # answered locally: the view is fresh and the revision unchanged
    # Another process lowers the limit below the usage: the next call sees it.
    lower = (
        "from elastickv.control import open_ledger\n"
        f"with open_ledger(total_bytes={BUDGET}, utilization=1.0, create=False) as other:\n"
        "    other.set_limit('a', '8M')\n"
    )
    subprocess.run([sys.executable, "-c", lower], check=True, env=os.environ.copy())
    assert a.over_limit_bytes() == 4 * MiB == a.info().over_limit_bytes
    reads.clear()
    a.release(2 * MiB)  # its own usage changes: counted locally, same answer as the ledger
    assert a.over_limit_bytes() == 2 * MiB
    assert reads == []
    assert a.info().over_limit_bytes == 2 * MiB
    ledger.set_limit("a", None)
    assert a.over_limit_bytes() == 0 == a.info().over_limit_bytes
    # A view older than OVER_LIMIT_VIEW_NS asks the ledger, even with the same revision.
    reads.clear()
    monkeypatch.setattr(ledger_module, "OVER_LIMIT_VIEW_NS", 0)
    assert a.over_limit_bytes() == 0
    assert reads == ["info"]


def test_a_sleep_request_and_its_answer_round_trip(ledger: Ledger) -> None:
    """Serve asks through the record; the owner answers in it; withdrawing forgets a refusal.
    The bits survive every other write to the record (admission, limits, credit, floor)."""
    handle = ledger.register("sleepy", limit=8 * MiB)
    other = ledger.register("awake")

    def flags(name: str) -> tuple[bool, bool, bool]:
        (info,) = [i for i in ledger.list_instances() if i.name == name]
        return info.sleep_wanted, info.asleep, info.sleep_refused

    assert flags("sleepy") == (False, False, False) and not handle.sleep_wanted()
    ledger.request_sleep("sleepy")
    assert handle.sleep_wanted() and flags("sleepy") == (True, False, False)
    assert flags("awake") == (False, False, False) and not other.sleep_wanted()
    handle.set_sleep_state(asleep=True)
    assert handle.try_admit(MiB)
    ledger.set_limit("sleepy", 4 * MiB)
    handle.settle(MiB, MiB)
    handle.set_floor_bytes(PAGE)
    handle.release(MiB)
    assert flags("sleepy") == (True, True, False)
    ledger.request_sleep("sleepy", False)
    assert flags("sleepy") == (False, True, False)  # the owner wakes, then says so
    handle.set_sleep_state(asleep=False)
    ledger.request_sleep("sleepy")
    handle.set_sleep_state(asleep=False, refused=True)
    assert flags("sleepy") == (True, False, True)
    ledger.request_sleep("sleepy", False)
    assert flags("sleepy") == (False, False, False)
    with pytest.raises(UnknownInstance, match="no live instance named 'nobody'"):
        ledger.request_sleep("nobody")
    handle.close()
    with pytest.raises(InstanceClosed):
        handle.sleep_wanted()
