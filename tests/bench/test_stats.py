"""The benchmarks' statistics: the median of repeated runs with its interval, and the
requests that follow an idle gap."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastickv.bench.stats import after_idle, median_interval

RUNS = st.lists(st.floats(0.01, 100.0, allow_nan=False), min_size=1, max_size=12)


@given(RUNS)
def test_the_interval_holds_the_median_within_the_runs(values: list[float]) -> None:
    found = median_interval(values)
    assert found["n"] == len(values)
    assert min(values) <= found["low"] <= found["median"] <= found["high"] <= max(values)


@given(RUNS)
def test_the_same_runs_give_the_same_interval(values: list[float]) -> None:
    assert median_interval(values) == median_interval(list(values))


def test_one_run_has_no_spread_and_agreeing_runs_none_either() -> None:
    assert median_interval([1.4]) == {"median": 1.4, "low": 1.4, "high": 1.4, "n": 1}
    assert median_interval([2.0] * 5) == {"median": 2.0, "low": 2.0, "high": 2.0, "n": 5}


def test_runs_that_disagree_widen_the_interval() -> None:
    """Three runs (three `--quick` runs once gave these p99 ratios: 1.17, 1.14, 0.64): the median
    is the middle one; the interval reaches the outlier, which a single sample would hide."""
    found = median_interval([1.17, 1.14, 0.64])
    assert found["median"] == pytest.approx(1.14)
    assert found["low"] == pytest.approx(0.64)
    assert found["high"] == pytest.approx(1.17)
    tight = median_interval([1.13, 1.14, 1.15, 1.14, 1.13, 1.15, 1.14])
    assert tight["high"] - tight["low"] < 0.021


def test_no_runs_and_bad_arguments() -> None:
    assert median_interval([]) == {"median": None, "low": None, "high": None, "n": 0}
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0], confidence=1.0)
    with pytest.raises(ValueError, match="resamples"):
        median_interval([1.0], resamples=0)
    with pytest.raises(ValueError, match="finite"):
        median_interval([1.0, float("nan")])


def report(p99: float | None, mean: float, failed: int = 0) -> dict[str, object]:
    """A bench_serve report with one workload (the ramp) and its ``all`` row only."""
    row = {"ratio_ttft_mean": mean, "ratio_ttft_p99": p99, "ratio_e2e_mean": 1.0}
    return {"workloads": {"ramp": {"models": {"all": row}, "failed": {"elastic": failed}}}}


def test_repeated_runs_are_judged_on_their_medians() -> None:
    from elastickv.bench.repeats import over_runs

    runs = [report(2.4, 1.3), report(0.64, 1.1), report(2.2, 1.4)]
    found = over_runs(runs, target_p99=2.0, target_mean=1.25)
    p99 = found["ratios"]["ramp"]["all"]["ratio_ttft_p99"]
    assert (p99["median"], p99["n"], p99["runs"]) == (2.2, 3, [2.4, 0.64, 2.2])
    assert found["target"]["met"]  # the outlier moves the interval, not the median
    assert found["target"]["p99_ttft_interval"] == [0.64, 2.4]
    assert not over_runs([*runs[:2], report(2.2, 1.4, failed=1)], 2.0, 1.25)["target"]["met"]
    missing = over_runs([report(None, 1.3), report(2.1, 1.3)], 2.0, 1.25)
    assert missing["ratios"]["ramp"]["all"]["ratio_ttft_p99"]["n"] == 1  # the run without one
    with pytest.raises(ValueError, match="no runs"):
        over_runs([], 2.0, 1.25)


@given(
    st.lists(st.tuples(st.sampled_from("ab"), st.floats(0, 1000, allow_nan=False)), max_size=30),
    st.floats(0.5, 200),
)
def test_after_idle_finds_each_request_its_model_idled_before(
    sends: list[tuple[str, float]], idle: float
) -> None:
    """Exactly the requests sent at least ``idle`` after their model's previous one."""
    from elastickv.bench.client import Result

    results = [Result(m, t, 0.1, 0.2, 1, 1, 200) for m, t in sends]
    found = after_idle(results, idle)
    for r in results:
        earlier = [o.sent_at for o in results if o.model == r.model and o.sent_at < r.sent_at]
        same = [o for o in results if o.model == r.model and o.sent_at == r.sent_at]
        if len(same) > 1:
            continue  # ties: the order among them decides; both are covered below
        expected = bool(earlier) and r.sent_at - max(earlier) >= idle
        assert (r in found) == expected, (r, earlier)
    assert len(found) <= len(results) - len({m for m, _ in sends})
