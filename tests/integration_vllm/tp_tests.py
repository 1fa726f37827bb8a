"""Tensor-parallel engine tests (TP=2, ``vllm.LLM`` stepped by hand, in-process engine core,
workers in their own processes), shared by the 0.28 and 0.32 files that import them: greedy
ids identical to native vLLM TP=2, each rank's memfd footprint exactly what the scheduler
committed for it, and a budget that forces refusals (preemptions, ids still identical, the
footprint and the ledger peak within the budget)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plugin_harness import ELASTIC, TP_ARGS, TP_BUDGET, assert_ranks_exact
from plugin_harness import TP_BIND as BIND

__all__ = [
    "test_tp2_budget_forces_refusals_ids_identical",
    "test_tp2_each_rank_footprint_is_what_the_scheduler_committed",
    "test_tp2_outputs_identical_to_native_tp2",
]

EngineRuns = Callable[..., dict[str, Any]]
ALL = ("all", "--max-tokens", "64", "--no-prefix-caching", *TP_ARGS)


def test_tp2_outputs_identical_to_native_tp2(runs: EngineRuns) -> None:
    native = runs("tiny-llama", *ALL, **BIND)
    elastic = runs("tiny-llama", *ALL, **BIND, **ELASTIC)
    assert elastic["elastic"] and not native["elastic"]
    assert elastic["functional"] == native["functional"]
    assert len(elastic["concurrent"]) == 16 and all(len(t) == 64 for t in elastic["concurrent"])
    assert elastic["concurrent"] == native["concurrent"]


def test_tp2_each_rank_footprint_is_what_the_scheduler_committed(runs: EngineRuns) -> None:
    elastic = runs("tiny-llama", *ALL, **BIND, **ELASTIC)
    samples = [elastic["idle"], *elastic["samples"], elastic["after"]]
    assert_ranks_exact(samples)
    idle = elastic["idle"]["footprint_bytes"]
    peak = max(s["footprint_bytes"] for s in elastic["samples"])
    print(f"\n[vllm-tp2 elastic] idle {idle} peak {peak} after {elastic['after']}")
    assert idle > 0 and peak >= 4 * idle
    (running,) = elastic["ledger_served"]["instances"]
    assert running["peak_bytes"] >= peak
    assert elastic["ledger_after"]["instances"] == []


def test_tp2_budget_forces_refusals_ids_identical(runs: EngineRuns) -> None:
    native = runs("tiny-llama", *ALL, **BIND)
    args = ("concurrent", "--max-tokens", "64", "--no-prefix-caching", *TP_ARGS)
    elastic = runs("tiny-llama", *args, ELASTICKV_BUDGET=str(TP_BUDGET), **BIND, **ELASTIC)
    assert elastic["preemptions"] > 0 and native["preemptions"] == 0
    assert elastic["after"]["refusals"] > 0
    assert_ranks_exact(elastic["samples"])
    assert max(s["footprint_bytes"] for s in elastic["samples"]) <= TP_BUDGET
    (served,) = elastic["ledger_served"]["instances"]
    assert served["peak_bytes"] <= TP_BUDGET and served["refusals"] > 0
    assert elastic["concurrent"] == native["concurrent"]
