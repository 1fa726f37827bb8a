"""Summaries of a run: per model latency percentiles, failures, memory-seconds."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from elastickv.bench.client import Result


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def latency_summary(results: Iterable[Result]) -> dict[str, Any]:
    """TTFT mean/p50/p99, end-to-end mean/p99, TPOT mean (seconds), requests, failures."""
    done = list(results)
    ok = [r for r in done if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    return {
        "requests": len(done),
        "failed": len(done) - len(ok),
        "ttft_mean": _mean(ttft),
        "ttft_p50": _pct(ttft, 50),
        "ttft_p99": _pct(ttft, 99),
        "e2e_mean": _mean(e2e),
        "e2e_p99": _pct(e2e, 99),
        "tpot_mean": _mean(tpot),
        "errors": sorted({r.error or f"status {r.status}" for r in done if not r.ok})[:5],
    }


def per_model(results: Sequence[Result], models: Sequence[str]) -> dict[str, dict[str, Any]]:
    summary = {m: latency_summary(r for r in results if r.model == m) for m in models}
    summary["all"] = latency_summary(results)
    return summary


def after_idle(results: Sequence[Result], idle_s: float) -> list[Result]:
    """The requests each sent after its model had no request sent for at least ``idle_s``:
    the first of every burst but the model's first (what a wake from a tier costs)."""
    found = []
    last: dict[str, float] = {}
    for result in sorted(results, key=lambda r: r.sent_at):
        before = last.get(result.model)
        if before is not None and result.sent_at - before >= idle_s:
            found.append(result)
        last[result.model] = result.sent_at
    return found


def memory_seconds(samples: Sequence[tuple[float, Mapping[str, int]]]) -> dict[str, float]:
    """∫ bytes dt per model (GiB·s) over (time, {model: bytes}) samples, trapezoids."""
    totals: dict[str, float] = {}
    for (t0, a), (t1, b) in itertools.pairwise(samples):
        for name in set(a) | set(b):
            area = (a.get(name, 0) + b.get(name, 0)) / 2 * (t1 - t0)
            totals[name] = totals.get(name, 0.0) + area / (1 << 30)
    return totals


def median_interval(
    values: Sequence[float], confidence: float = 0.95, resamples: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """The median of ``values`` (one per repeated run) and a percentile-bootstrap interval
    for it at ``confidence``: the runs resampled with replacement ``resamples`` times
    (seeded: the same runs give the same interval). With few runs the interval is wide (with
    three it spans about their range): it says how far one more run could move the median.
    ``n`` is the number of runs; every field but ``n`` is None without any."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    data = np.asarray([float(v) for v in values], dtype=float)
    if data.size == 0:
        return {"median": None, "low": None, "high": None, "n": 0}
    if not np.all(np.isfinite(data)):
        raise ValueError(f"every value must be a finite number, got {values!r}")
    picks = np.random.default_rng(seed).integers(0, data.size, size=(resamples, data.size))
    medians = np.median(data[picks], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return {
        "median": float(np.median(data)),
        "low": float(low),
        "high": float(high),
        "n": int(data.size),
    }


def ratio(static: float | None, elastic: float | None) -> float | None:
    if static is None or elastic is None or elastic <= 0:
        return None
    return static / elastic


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram's (upper bound, cumulative count) buckets,
    interpolated linearly within its bucket as Prometheus' ``histogram_quantile`` does: an
    estimate, no finer than the bucket bounds. None without observations; the highest finite
    bound if it falls in ``+Inf``."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower
