"""A benchmark repeated: every static/elastic ratio of its runs' reports as a median with a
bootstrap interval (``bench_serve.py --repeat``)."""

from __future__ import annotations

from typing import Any

from elastickv.bench.stats import median_interval

RATIOS = ("ratio_ttft_mean", "ratio_ttft_p99", "ratio_e2e_mean")


def over_runs(runs: list[dict[str, Any]], target_p99: float, target_mean: float) -> dict[str, Any]:
    """Every ratio of the runs' reports (``bench_serve``'s: workloads, then models, then
    ``ratio_*``) as its median over the runs and a bootstrap interval
    (:func:`~elastickv.bench.stats.median_interval`), with each run's value (None where a
    run had none); the ramp target judged on the medians, and on no failure in any run."""
    if not runs:
        raise ValueError("no runs to summarise")
    ratios: dict[str, Any] = {}
    for name, workload in runs[0]["workloads"].items():
        ratios[name] = {}
        for model in workload["models"]:
            row: dict[str, Any] = {}
            for key in RATIOS:
                values = [run["workloads"][name]["models"][model][key] for run in runs]
                row[key] = {
                    **median_interval([v for v in values if v is not None]),
                    "runs": values,
                }
            ratios[name][model] = row
    doc: dict[str, Any] = {"repeats": len(runs), "ratios": ratios}
    ramp = ratios.get("ramp")
    if ramp:
        p99, mean = ramp["all"]["ratio_ttft_p99"], ramp["all"]["ratio_ttft_mean"]
        failed = sum(run["workloads"]["ramp"]["failed"]["elastic"] for run in runs)
        doc["target"] = {
            "p99_ttft_ratio": p99["median"],
            "p99_ttft_interval": [p99["low"], p99["high"]],
            "mean_ttft_ratio": mean["median"],
            "mean_ttft_interval": [mean["low"], mean["high"]],
            "elastic_failed": failed,
            "met": bool(
                (p99["median"] or 0) >= target_p99
                and (mean["median"] or 0) >= target_mean
                and failed == 0
            ),
        }
    return doc
