"""The smallest budget at which a noisy benchmark meets its latency target
(``bench_serve.py --sweep``), and the most models it meets it for at one budget
(``bench_serve.py --fit``).

A point (one budget, or one number of models) is judged by the median of ``repeats`` runs
(odd): it passes when the median run's TTFT p99 is within the target and that run failed
nothing, that is when most runs pass. Runs stop as soon as the majority is settled: two
passes out of three already fix the median, so a third run could not change the verdict.

The budget search assumes more budget never hurts (a point that passes stays passing above
it): it doubles from the smallest budget until a point passes, then halves the gap
geometrically between the largest failing budget and the smallest passing one until they are
within ``resolution`` of each other. The count search assumes fewer models never hurt, and
brackets the largest passing count exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Trial:
    """One run at one setting: its TTFT p99 over every model (seconds; None when nothing
    was answered) and its failed requests."""

    ttft_p99: float | None
    failed: int

    def passes(self, slo_s: float) -> bool:
        return self.failed == 0 and self.ttft_p99 is not None and self.ttft_p99 <= slo_s


@dataclass(frozen=True)
class Point:
    """One setting tried (a budget in bytes, or a number of models), its runs, and the
    verdict of their median."""

    at: int
    trials: tuple[Trial, ...]
    passed: bool

    @property
    def median_p99(self) -> float | None:
        """The median run's TTFT p99, a run with failures counting as unbounded (None if
        the median run is one)."""
        values = [
            t.ttft_p99 if t.failed == 0 and t.ttft_p99 is not None else math.inf
            for t in self.trials
        ]
        found = float(np.median(values))
        return found if math.isfinite(found) else None

    def as_json(self, key: str = "budget_bytes") -> dict[str, Any]:
        return {
            key: self.at,
            "passed": self.passed,
            "median_ttft_p99_s": self.median_p99,
            "repeats": len(self.trials),
            "ttft_p99_s": [t.ttft_p99 for t in self.trials],
            "failed": [t.failed for t in self.trials],
        }


def judge(run: Callable[[int], Trial], at: int, repeats: int, slo_s: float) -> Point:
    """Run at ``at`` (a budget, or a number of models) until the median of ``repeats`` runs
    is settled."""
    if repeats < 1 or repeats % 2 == 0:
        raise ValueError(f"repeats must be an odd number of at least 1, got {repeats}")
    if slo_s <= 0:
        raise ValueError(f"the TTFT target must be positive, got {slo_s} s")
    majority = repeats // 2 + 1
    trials: list[Trial] = []
    while True:
        trials.append(run(at))
        passes = sum(t.passes(slo_s) for t in trials)
        if passes >= majority or len(trials) - passes >= majority:
            return Point(at, tuple(trials), passes >= majority)


@dataclass(frozen=True)
class Search:
    """Every point tried (in order) and the bracket they leave: the target is met from
    ``smallest_passing`` up and missed at ``largest_failing`` (None: not found in range)."""

    points: tuple[Point, ...]
    smallest_passing: int | None
    largest_failing: int | None

    def as_json(self) -> dict[str, Any]:
        return {
            "smallest_passing_bytes": self.smallest_passing,
            "largest_failing_bytes": self.largest_failing,
            "points": [p.as_json() for p in sorted(self.points, key=lambda p: p.at)],
        }


def _align(value: float, step: int) -> int:
    return max(step, round(value / step) * step)


def _judged_once(
    judge_at: Callable[[int], Point], points: dict[int, Point]
) -> Callable[[int], Point]:
    """``judge_at`` remembered in ``points``: a search never judges one setting twice."""

    def at(setting: int) -> Point:
        if setting not in points:
            points[setting] = judge_at(setting)
        return points[setting]

    return at


def smallest_passing(
    judge_at: Callable[[int], Point], low: int, high: int, step: int, resolution: float
) -> Search:
    """The smallest budget in ``[low, high]`` (multiples of ``step``) whose point passes, to
    within a factor ``resolution`` (> 1) or one step: doubling from ``low``, then geometric
    bisection. Each budget is judged once."""
    if step < 1 or low < step or low % step or high % step:
        raise ValueError(f"low {low} and high {high} must be multiples of the step {step}")
    if high < low:
        raise ValueError(f"high {high} is below low {low}")
    if resolution <= 1:
        raise ValueError(f"resolution must be above 1, got {resolution}")
    points: dict[int, Point] = {}
    at = _judged_once(judge_at, points)

    failing: int | None = None
    budget = low
    while not at(budget).passed:
        failing = budget
        if budget == high:
            return Search(tuple(points.values()), None, failing)
        budget = min(high, budget * 2)
    passing = budget
    while failing is not None and passing > failing * resolution and passing - failing > step:
        middle = _align(math.sqrt(failing * passing), step)
        if not failing < middle < passing:
            break
        if at(middle).passed:
            passing = middle
        else:
            failing = middle
    return Search(tuple(points.values()), passing, failing)


def capacity_ratio(static: Search, elastic: Search) -> dict[str, Any]:
    """B_static / B_elastic and the interval the two brackets leave: each arm's threshold
    lies above its largest failing budget and at or below its smallest passing one (at it,
    when the arm passed at the first budget of its search, the smallest it can start with).
    None throughout when an arm never passed."""
    if static.smallest_passing is None or elastic.smallest_passing is None:
        return {"ratio": None, "low": None, "high": None}
    s_pass, e_pass = static.smallest_passing, elastic.smallest_passing
    s_fail = static.largest_failing or s_pass
    e_fail = elastic.largest_failing or e_pass
    return {"ratio": s_pass / e_pass, "low": s_fail / e_pass, "high": s_pass / e_fail}


@dataclass(frozen=True)
class CountSearch:
    """Every number of models tried and the bracket they leave: the target is met with
    ``largest_passing`` models (None: not even with the fewest tried) and missed with
    ``smallest_failing`` (None: met up to the largest count tried)."""

    points: tuple[Point, ...]
    largest_passing: int | None
    smallest_failing: int | None

    def as_json(self) -> dict[str, Any]:
        return {
            "largest_passing_models": self.largest_passing,
            "smallest_failing_models": self.smallest_failing,
            "points": [p.as_json("models") for p in sorted(self.points, key=lambda p: p.at)],
        }


def largest_passing(
    judge_at: Callable[[int], Point], start: int, high: int, stride: int
) -> CountSearch:
    """The largest count in ``[1, high]`` whose point passes, exactly: from ``start`` up by
    ``stride`` while it passes, down by one while it fails (a count costs a run per model:
    small steps down are cheap), then bisection between the two. Each count judged once."""
    if not 1 <= start <= high:
        raise ValueError(f"start {start} must lie in [1, high {high}]")
    if stride < 1:
        raise ValueError(f"stride must be at least 1, got {stride}")
    points: dict[int, Point] = {}
    at = _judged_once(judge_at, points)

    passing: int | None = None
    failing: int | None = None
    count = start
    if at(count).passed:
        passing = count
        while passing < high:
            count = min(high, passing + stride)
            if not at(count).passed:
                failing = count
                break
            passing = count
    else:
        failing = count
        while failing > 1 and passing is None:
            count = failing - 1
            if at(count).passed:
                passing = count
            else:
                failing = count
    while passing is not None and failing is not None and failing - passing > 1:
        middle = (passing + failing) // 2
        if at(middle).passed:
            passing = middle
        else:
            failing = middle
    return CountSearch(tuple(points.values()), passing, failing)
