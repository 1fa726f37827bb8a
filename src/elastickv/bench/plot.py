"""The pictures of a benchmark: a run's committed KV memory per model over time (stacked, one
panel per arm, with the budget line) and TTFT distribution per model; a sweep's TTFT p99
against the budget, per arm."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elastickv.bench.client import Result

MiB = float(1 << 20)


def plot_run(
    path: Path,
    arms: Mapping[str, dict[str, Any]],
    models: Sequence[str],
    budget: int,
    title: str,
) -> Path:
    """``arms`` maps an arm name to ``{"memory": [(t, {model: bytes})], "results": [Result]}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(arms)
    fig, axes = plt.subplots(2, len(names), figsize=(6.5 * len(names), 8.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, arm in enumerate(names):
        memory = arms[arm]["memory"]
        ax = axes[0][col]
        if memory:
            times = [t for t, _ in memory]
            stacks = [[sample.get(m, 0) / MiB for _, sample in memory] for m in models]
            ax.stackplot(times, stacks, labels=models, colors=colors[: len(models)], alpha=0.8)
        ax.axhline(budget / MiB, color="black", linestyle="--", linewidth=1.2, label="budget B")
        ax.set_title(f"{arm}: committed KV memory per model")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_ylim(0, budget / MiB * 1.15)
        ax.legend(loc="upper right", fontsize=8)
        results: list[Result] = arms[arm]["results"]
        ax2 = axes[1][col]
        data = [[r.ttft for r in results if r.model == m and r.ok and r.ttft is not None]
                for m in models]  # fmt: skip
        ax2.boxplot([d or [0.0] for d in data], whis=(1, 99), showfliers=True)
        ax2.set_xticks(range(1, len(models) + 1), models)
        ax2.set_yscale("log")
        ax2.set_title(f"{arm}: TTFT per model (box: p25-p75, whiskers: p1-p99)")
        ax2.set_ylabel("seconds (log)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(path: Path, sweep: Mapping[str, Any]) -> Path:
    """``bench_serve --sweep``'s JSON (``sweep``): every run's TTFT p99 against its budget,
    each budget's median joined per arm, the target line, each arm's smallest passing
    budget marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    slo = sweep["target"]["ttft_p99_s"]
    for color, (arm, found) in zip(colors, sweep["arms"].items(), strict=False):
        points = found["points"]
        for point in points:
            runs = [p if p is not None else float("nan") for p in point["ttft_p99_s"]]
            ax.scatter([point["budget_bytes"] / MiB] * len(runs), runs, color=color, alpha=0.4)
        medians = [(p["budget_bytes"] / MiB, p["median_ttft_p99_s"]) for p in points]
        ax.plot(*zip(*medians, strict=True), color=color, marker="o", label=f"{arm} (median)")
        if found["smallest_passing_bytes"]:
            ax.axvline(found["smallest_passing_bytes"] / MiB, color=color, linestyle=":")
    ax.axhline(slo, color="black", linestyle="--", linewidth=1.2, label=f"target {slo} s")
    ax.set_xlabel("KV budget B (MiB)")
    ax.set_ylabel("TTFT p99, all models (s, log)")
    ax.set_yscale("log")
    ratio = sweep["capacity_ratio"]["ratio"]
    ax.set_title(
        "TTFT p99 against the budget"
        + (f": B_static / B_elastic = {ratio:.2f}" if ratio is not None else "")
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
