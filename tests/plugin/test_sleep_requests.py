"""The engine core's answers to a sleep request in its ledger record (a real ledger; the
engine core is a stand-in recording its worker RPCs: real engines sleep in
tests/integration_vllm, under ``elastickv serve`` and alone)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastickv.control import InstanceHandle, Ledger, open_ledger
from elastickv.integrations.vllm.engine.sleep_requests import SleepRequests
from elastickv.integrations.vllm.worker.weights_sleep import SLEEP_METHOD, WAKE_METHOD


class EngineCore:
    """Records ``collective_rpc`` calls; ranks answer as the worker RPCs do, or fail."""

    def __init__(self, ranks: int = 2, sleep_fails: bool = False) -> None:
        self.ranks = ranks
        self.sleep_fails = sleep_fails
        self.calls: list[str] = []
        self.levels: list[int] = []

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def collective_rpc(
        self, method: str, kwargs: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        self.calls.append(method)
        if method == SLEEP_METHOD:
            self.levels.append((kwargs or {})["level"])
        if method == SLEEP_METHOD and self.sleep_fails:
            raise RuntimeError("elastickv's weight sleep releases CPU memory only")
        return [{"released_bytes": 100}] * self.ranks


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with open_ledger("host", directory=str(tmp_path), total_bytes=64 << 20) as opened:
        yield opened


@pytest.fixture
def handle(ledger: Ledger) -> Iterator[InstanceHandle]:
    with ledger.register("engine") as registered:
        yield registered


def record(ledger: Ledger) -> tuple[bool, bool, bool]:
    (info,) = ledger.list_instances()
    return info.sleep_wanted, info.asleep, info.sleep_refused


def test_idle_ticks_sleep_on_request_and_wake_when_withdrawn(
    ledger: Ledger, handle: InstanceHandle
) -> None:
    core = EngineCore()
    sleep = SleepRequests(core, handle)
    sleep.on_idle()
    assert core.calls == [] and not sleep.asleep
    ledger.request_sleep("engine")
    sleep.on_idle()
    sleep.on_idle()  # asleep already: nothing more
    assert core.calls == [SLEEP_METHOD] and sleep.asleep
    assert record(ledger) == (True, True, False)
    sleep.before_step()
    assert core.calls == [SLEEP_METHOD, WAKE_METHOD] and not sleep.asleep
    assert record(ledger) == (True, False, False)
    ledger.request_sleep("engine", False)
    sleep.on_idle()
    assert core.calls == [SLEEP_METHOD, WAKE_METHOD]  # awake already
    ledger.request_sleep("engine")
    sleep.on_idle()
    ledger.request_sleep("engine", False)
    sleep.on_idle()
    assert core.calls[2:] == [SLEEP_METHOD, WAKE_METHOD] and record(ledger) == (False,) * 3
    assert (sleep.sleeps, sleep.wakes) == (2, 2)


def test_an_engine_that_cannot_sleep_refuses_once_and_keeps_its_weights(
    ledger: Ledger, handle: InstanceHandle
) -> None:
    core = EngineCore(sleep_fails=True)
    sleep = SleepRequests(core, handle)
    ledger.request_sleep("engine")
    sleep.on_idle()
    # Every rank is woken again: one that had released its weights gets them back.
    assert core.calls == [SLEEP_METHOD, WAKE_METHOD] and not sleep.asleep
    assert record(ledger) == (True, False, True)
    sleep.on_idle()
    assert len(core.calls) == 2  # refused: not tried again while the request stands
    ledger.request_sleep("engine", False)
    sleep.on_idle()
    assert record(ledger) == (False, False, False) and not sleep.refused


def test_a_failed_wake_stops_the_step(ledger: Ledger, handle: InstanceHandle) -> None:
    """A model without its weights must not run: the error reaches the engine core."""
    core = EngineCore()
    sleep = SleepRequests(core, handle)
    ledger.request_sleep("engine")
    sleep.on_idle()

    def broken(method: str, kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        raise RuntimeError(f"{method}: the checkpoint is gone")

    core.collective_rpc = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="checkpoint is gone"):
        sleep.before_step()
    assert sleep.asleep  # still asleep: the next step tries again


def test_a_closed_record_is_left_alone(ledger: Ledger, handle: InstanceHandle) -> None:
    core = EngineCore()
    sleep = SleepRequests(core, handle)
    ledger.request_sleep("engine")
    handle.close()
    sleep.on_idle()
    assert core.calls == []


def test_the_level_reaches_every_rank_and_level_2_resets_the_prefix_cache_first(
    ledger: Ledger, handle: InstanceHandle
) -> None:
    """Level 2 reloads the weights from the checkpoint: the cached blocks are dropped (and
    their pages handed back) before; level 1 brings back the very bytes and keeps them."""
    flushed: list[str] = []
    for level, before in ((1, []), (2, ["reset_prefix_cache"])):
        core = EngineCore()
        sleep = SleepRequests(core, handle, level, flush=lambda: flushed.append("flush"))
        ledger.request_sleep("engine")
        sleep.on_idle()
        assert core.calls == [*before, SLEEP_METHOD] and core.levels == [level]
        ledger.request_sleep("engine", False)
        sleep.on_idle()
    assert flushed == ["flush"]
