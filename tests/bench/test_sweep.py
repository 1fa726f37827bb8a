"""The budget sweep's search: the median verdict of repeated runs, the bracket found by
doubling and geometric bisection, and the capacity ratio's interval; the count search of
``--fit``: the largest number of models that passes, exactly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastickv.bench.sweep import (
    CountSearch,
    Point,
    Search,
    Trial,
    capacity_ratio,
    judge,
    largest_passing,
    smallest_passing,
)

STEP = 64 << 10
SLO = 1.0


def scripted(values: list[Trial]) -> tuple[list[int], Callable[[int], Trial]]:
    calls: list[int] = []
    feed = iter(values)

    def run(budget: int) -> Trial:
        calls.append(budget)
        return next(feed)

    return calls, run


def test_two_agreeing_runs_settle_the_median_of_three() -> None:
    calls, run = scripted([Trial(0.5, 0), Trial(0.7, 0), Trial(9.0, 0)])
    point = judge(run, STEP, repeats=3, slo_s=SLO)
    assert point.passed and len(point.trials) == 2 and calls == [STEP, STEP]
    assert point.median_p99 == pytest.approx(0.6)


def test_a_split_needs_the_third_run_and_failures_count_as_unbounded() -> None:
    _, run = scripted([Trial(0.5, 0), Trial(0.4, 2), Trial(3.0, 0)])
    point = judge(run, STEP, repeats=3, slo_s=SLO)
    assert not point.passed and len(point.trials) == 3
    assert point.median_p99 == pytest.approx(3.0)  # the failed run sorts last, not at 0.4
    _, run = scripted([Trial(None, 5), Trial(2.0, 1), Trial(0.1, 0)])
    assert judge(run, STEP, 3, SLO).median_p99 is None


@pytest.mark.parametrize("repeats", [0, 2, -1])
def test_an_even_or_empty_repeat_count_is_refused(repeats: int) -> None:
    with pytest.raises(ValueError, match="odd"):
        judge(lambda b: Trial(0.1, 0), STEP, repeats, SLO)


def test_bad_search_ranges_are_refused() -> None:
    never = lambda b: Point(b, (), True)  # noqa: E731
    with pytest.raises(ValueError, match="multiples"):
        smallest_passing(never, STEP + 1, 8 * STEP, STEP, 1.2)
    with pytest.raises(ValueError, match="below"):
        smallest_passing(never, 8 * STEP, STEP, STEP, 1.2)
    with pytest.raises(ValueError, match="resolution"):
        smallest_passing(never, STEP, 8 * STEP, STEP, 1.0)


@given(
    low=st.integers(1, 40),
    span=st.integers(0, 400),
    threshold=st.integers(1, 600),
    resolution=st.floats(1.05, 2.0),
)
def test_the_bracket_holds_the_threshold_within_the_resolution(
    low: int, span: int, threshold: int, resolution: float
) -> None:
    """Any monotone verdict (pass from ``threshold`` steps up): the search ends with the
    largest failing budget below the threshold and the smallest passing one at or above it,
    within the resolution or one step of each other, judging no budget twice."""
    low_b, high_b, threshold_b = low * STEP, (low + span) * STEP, threshold * STEP
    judged: list[int] = []

    def at(budget: int) -> Point:
        judged.append(budget)
        assert low_b <= budget <= high_b and budget % STEP == 0
        return Point(budget, (Trial(0.1, 0),), budget >= threshold_b)

    found = smallest_passing(at, low_b, high_b, STEP, resolution)
    assert len(judged) == len(set(judged)) == len(found.points)
    if threshold_b > high_b:
        assert found.smallest_passing is None and found.largest_failing == high_b
        return
    assert found.smallest_passing is not None and found.smallest_passing >= threshold_b
    if found.largest_failing is None:
        assert found.smallest_passing == low_b
        return
    assert found.largest_failing < threshold_b
    gap = found.smallest_passing - found.largest_failing
    assert gap <= STEP or found.smallest_passing <= found.largest_failing * resolution * 1.01


def test_the_ratio_interval_spans_both_brackets() -> None:
    def search(passing: int | None, failing: int | None) -> Search:
        return Search((), passing, failing)

    found = capacity_ratio(search(24, 20), search(10, 8))
    assert found == {"ratio": 2.4, "low": 2.0, "high": 3.0}
    # an arm that passed at the smallest budget it can start with: its threshold is that budget
    assert capacity_ratio(search(24, 20), search(10, None)) == {
        "ratio": 2.4, "low": 2.0, "high": 2.4,
    }  # fmt: skip
    assert capacity_ratio(search(None, 64), search(10, 8))["ratio"] is None


def test_points_report_every_run() -> None:
    point = Point(3 * STEP, (Trial(0.5, 0), Trial(None, 4)), False)
    assert point.as_json() == {
        "budget_bytes": 3 * STEP,
        "passed": False,
        "median_ttft_p99_s": None,
        "repeats": 2,
        "ttft_p99_s": [0.5, None],
        "failed": [0, 4],
    }
    ordered = Search((Point(2, (), True), Point(1, (), False)), 2, 1).as_json()["points"]
    assert [p["budget_bytes"] for p in ordered] == [1, 2]


@given(
    high=st.integers(1, 30),
    start=st.integers(1, 30),
    threshold=st.integers(0, 31),
    stride=st.integers(1, 6),
)
def test_the_count_search_finds_the_largest_passing_count_exactly(
    high: int, start: int, threshold: int, stride: int
) -> None:
    """Any monotone verdict (pass up to ``threshold`` models): the search ends with the
    largest passing count and the next one failing, judging no count twice and none outside
    ``[1, high]``."""
    start = min(start, high)
    judged: list[int] = []

    def at(count: int) -> Point:
        judged.append(count)
        assert 1 <= count <= high
        return Point(count, (Trial(0.1, 0),), count <= threshold)

    found = largest_passing(at, start, high, stride)
    assert len(judged) == len(set(judged)) == len(found.points)
    expected = min(threshold, high)
    assert found.largest_passing == (expected or None)
    assert found.smallest_failing == (expected + 1 if expected < high else None)


def test_a_count_search_steps_down_by_one_from_a_failing_start() -> None:
    judged: list[int] = []

    def at(count: int) -> Point:
        judged.append(count)
        return Point(count, (), count <= 2)

    found = largest_passing(at, 3, 9, 3)
    assert judged == [3, 2] and (found.largest_passing, found.smallest_failing) == (2, 3)


def test_bad_count_searches_are_refused() -> None:
    never = lambda n: Point(n, (), True)  # noqa: E731
    with pytest.raises(ValueError, match="start"):
        largest_passing(never, 0, 4, 1)
    with pytest.raises(ValueError, match="start"):
        largest_passing(never, 5, 4, 1)
    with pytest.raises(ValueError, match="stride"):
        largest_passing(never, 1, 4, 0)


def test_count_points_are_reported_by_models() -> None:
    found = CountSearch(
        (Point(6, (Trial(None, 3),), False), Point(3, (Trial(0.2, 0),), True)), 3, 6
    )
    assert found.as_json() == {
        "largest_passing_models": 3,
        "smallest_failing_models": 6,
        "points": [
            {
                "models": 3, "passed": True, "median_ttft_p99_s": 0.2, "repeats": 1,
                "ttft_p99_s": [0.2], "failed": [0],
            },
            {
                "models": 6, "passed": False, "median_ttft_p99_s": None, "repeats": 1,
                "ttft_p99_s": [None], "failed": [3],
            },
        ],
    }  # fmt: skip
