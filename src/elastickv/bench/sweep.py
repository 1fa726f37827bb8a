"""The smallest budget at which a noisy benchmark meets its latency target
(``bench_serve.py --sweep``).

A point (one budget) is judged by the median of ``repeats`` runs (odd): it passes when the
median run's TTFT p99 is within the target and that run failed nothing, that is when most
runs pass. Runs stop as soon as the majority is settled: two passes out of three already fix
the median, so a third run could not change the verdict. The search assumes more budget
never hurts (a point that passes stays passing above it): it doubles from the smallest budget
until a point passes, then halves the gap geometrically between the largest failing budget
and the smallest passing one until they are within ``resolution`` of each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Trial:
    """One run at one budget: its TTFT p99 over every model (seconds; None when nothing
    was answered) and its failed requests."""

    ttft_p99: float | None
    failed: int

    def passes(self, slo_s: float) -> bool:
        return self.failed == 0 and self.ttft_p99 is not None and self.ttft_p99 <= slo_s


@dataclass(frozen=True)
class Point:
    """One budget tried, its runs, and the verdict of their median."""

    budget: int
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

    def as_json(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget,
            "passed": self.passed,
            "median_ttft_p99_s": self.median_p99,
            "repeats": len(self.trials),
            "ttft_p99_s": [t.ttft_p99 for t in self.trials],
            "failed": [t.failed for t in self.trials],
        }


def judge(run: Callable[[int], Trial], budget: int, repeats: int, slo_s: float) -> Point:
    """Run at ``budget`` until the median of ``repeats`` runs is settled."""
    if repeats < 1 or repeats % 2 == 0:
        raise ValueError(f"repeats must be an odd number of at least 1, got {repeats}")
    if slo_s <= 0:
        raise ValueError(f"the TTFT target must be positive, got {slo_s} s")
    majority = repeats // 2 + 1
    trials: list[Trial] = []
    while True:
        trials.append(run(budget))
        passes = sum(t.passes(slo_s) for t in trials)
        if passes >= majority or len(trials) - passes >= majority:
            return Point(budget, tuple(trials), passes >= majority)


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
            "points": [p.as_json() for p in sorted(self.points, key=lambda p: p.budget)],
        }


def _align(value: float, step: int) -> int:
    return max(step, round(value / step) * step)


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

    def at(budget: int) -> Point:
        if budget not in points:
            points[budget] = judge_at(budget)
        return points[budget]

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
