"""Tensor parallelism (TP=2) on elastic storage, real vLLM 0.28 (per-layer KV backings, each
rank's pool holding its shard of the KV heads): greedy ids identical to native vLLM 0.28
TP=2, each rank's footprint what the scheduler committed for it, and a budget that forces
refusals. The tests are shared with vLLM 0.32 (:mod:`tp_tests`)."""

from __future__ import annotations

from tp_tests import (
    test_tp2_budget_forces_refusals_ids_identical,
    test_tp2_each_rank_footprint_is_what_the_scheduler_committed,
    test_tp2_outputs_identical_to_native_tp2,
)

__all__ = [
    "test_tp2_budget_forces_refusals_ids_identical",
    "test_tp2_each_rank_footprint_is_what_the_scheduler_committed",
    "test_tp2_outputs_identical_to_native_tp2",
]
