"""elastickv engines in the host ledger (vLLM 0.32, multiprocess): `elastickv list` shows a
running engine under its default name, `elastickv limit` lowered while it idles is honoured
by the next steps (preempting, outputs still identical to native), no record survives
shutdown, and two engines whose virtual capacities together exceed a shared device budget
both serve to completion without the budget ever being exceeded."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from plugin_harness import (
    ELASTIC,
    MP_RUN_ARGS,
    PAGE,
    finish_engine,
    footprint_bytes,
    pool_fds,
    proc_fd_opens,
    start_engine,
)

from elastickv.control import open_ledger

EngineRuns = Callable[..., dict[str, Any]]
ARGS = MP_RUN_ARGS  # the native run is the mp tests' own (memoised)
SERVE_ARGS = ("concurrent", "--max-tokens", "64", "--no-prefix-caching")
LIMIT = 4 * PAGE  # the null block's slab (2 pages) + one slab: one request at a time


def _engine_core_pid(result: dict[str, Any]) -> int:
    return next(
        int(p) for p, name in result["shutdown"]["children"].items() if "EngineCore" in name
    )


def test_limit_lowered_while_idle_is_honoured(runs: EngineRuns) -> None:
    from elastickv.models import ensure_tiny_model

    native = runs("tiny-llama", *ARGS, mp=True)
    # 4 hot pages kept while idle, so the idle footprint (6 pages) is above the new limit.
    elastic = runs(
        "tiny-llama",
        *ARGS,
        "--ledger-limit",
        str(LIMIT),
        mp=True,
        ELASTICKV_HOT_MIN_PAGES="4",
        **ELASTIC,
    )
    (running,) = elastic["ledger_running"]["instances"]
    # The model's name, not its cache entry's (tiny-llama-<digest>) nor a pid: typable,
    # and the same on every run.
    assert os.path.basename(str(ensure_tiny_model("tiny-llama"))) != "tiny-llama"
    assert running["name"] == "tiny-llama"
    assert running["pid"] == _engine_core_pid(elastic)
    assert running["limit_desired"] is None
    before = elastic["footprint_before_limit"]["footprint_bytes"]
    samples = [s["footprint_bytes"] for s in elastic["samples"]]
    (served,) = elastic["ledger_served"]["instances"]
    print(
        f"\n[vllm-ledger limit] before {before} limit {LIMIT} samples max {max(samples)} {served}"
    )
    assert before > LIMIT
    assert max(samples) <= LIMIT  # from the first step after the limit on
    assert served["limit_desired"] == LIMIT and served["used_bytes"] <= LIMIT
    assert served["refusals"] > 0  # it kept serving by preempting under the limit
    assert elastic["functional"] == native["functional"]
    assert elastic["concurrent"] == native["concurrent"]
    assert all(len(t) == 64 for t in elastic["concurrent"])
    assert elastic["ledger_after"]["instances"] == []  # unregistered on shutdown


class _Monitor(threading.Thread):
    """Samples the ledger and the engines' memfd footprints under the ledger's lock (no
    admission or release can happen meanwhile, so the readings are one instant)."""

    def __init__(self, ledger_dir: Path, runners: list[int]) -> None:
        super().__init__(daemon=True)
        self.ledger_dir = ledger_dir
        self.runners = runners
        self.stop = threading.Event()
        self.samples: list[dict[str, int]] = []

    def _pools(self) -> dict[int, str]:
        found: dict[int, str] = {}
        for i, pid in enumerate(self.runners):
            with contextlib.suppress(psutil.Error):
                kids = [p.pid for p in psutil.Process(pid).children(recursive=True)]
                held = pool_fds(kids)
                if held:
                    found[i] = next(iter(held.values()))[0]
        return found

    def run(self) -> None:
        pools: dict[int, str] = {}
        with open_ledger(directory=str(self.ledger_dir), create=False) as ledger:
            while not self.stop.is_set():
                if len(pools) < len(self.runners):
                    pools = self._pools()
                with ledger.frozen() as snap:
                    feet: dict[int, int] = {}
                    for i, path in pools.items():
                        with contextlib.suppress(OSError):
                            feet[i] = footprint_bytes(path)
                    self.samples.append(
                        {
                            "used": snap.usage.used_bytes,
                            "budget": snap.usage.budget_bytes,
                            "instances": len(snap.instances),
                            "footprints": sum(feet.values()),
                            "pools": len(feet),
                        }
                    )
                time.sleep(0.02)


def test_two_engines_share_a_budget(runs: EngineRuns, cache_root: Path, tmp_path: Path) -> None:
    """Two engines, each alone wanting more than the device budget, start, then serve at
    once (a barrier: neither serves before both registered, so neither is refused its
    start-up by the other's burst): both complete with native outputs, the budget is never
    exceeded, and it bound each of them (the ledger refused each some of the credit it asked
    for)."""
    from elastickv.models import ensure_tiny_model

    native = runs("tiny-llama", *ARGS, mp=True)
    budget = 16 * PAGE  # each engine advertises 256M; together they want far more
    ledger_dir = tmp_path / "ledger"
    with open_ledger(directory=str(ledger_dir), total_bytes=budget, utilization=1.0):
        pass
    model = str(ensure_tiny_model("tiny-llama"))
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    extra = {**ELASTIC, "ELASTICKV_LEDGER_DIR": str(ledger_dir)}
    engines = [
        start_engine(
            cache_root,
            model,
            [*SERVE_ARGS, "--barrier", str(ready[i]), str(go)],
            extra,
            multiprocess=True,
        )
        for i in range(2)
    ]
    monitor = _Monitor(ledger_dir, [e.proc.pid for e in engines])
    monitor.start()
    try:
        deadline = time.monotonic() + 600
        while not all(path.exists() for path in ready):
            assert all(e.proc.poll() is None for e in engines), "an engine failed to start"
            assert time.monotonic() < deadline, "the engines never started"
            time.sleep(0.1)
        with open_ledger(directory=str(ledger_dir), create=False) as ledger:
            registered = {i.name: i for i in ledger.list_instances()}
        go.touch()
        results = [finish_engine(e) for e in engines]
    finally:
        go.touch()
        monitor.stop.set()
        monitor.join(timeout=30)
    peak_used = max(s["used"] for s in monitor.samples)
    peak_feet = max(s["footprints"] for s in monitor.samples)
    print(
        f"\n[vllm-ledger shared budget {budget}] samples {len(monitor.samples)}, peak ledger "
        f"{peak_used}, peak footprints {peak_feet}, serve_s {[r['serve_s'] for r in results]}"
    )
    assert len(registered) == 2  # both held their floor before either served
    assert all(s["budget"] == budget for s in monitor.samples)
    assert peak_used <= budget and peak_feet <= budget
    for result in results:
        assert result["concurrent"] == native["concurrent"]
        assert not result["shutdown"]["left"]
        assert proc_fd_opens(result) == []
        core = _engine_core_pid(result)
        (mine,) = [i for i in result["ledger_served"]["instances"] if i["pid"] == core]
        assert mine["refusals"] > 0, mine  # the budget bound it
        assert result["ledger_after"]["instances"] == [] or all(
            i["pid"] != core for i in result["ledger_after"]["instances"]
        )
    with open_ledger(directory=str(ledger_dir), create=False) as ledger:
        assert ledger.list_instances() == []
