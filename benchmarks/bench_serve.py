"""Several models on one KV budget B: a static split against ``elastickv serve``, same load.

Three tiny models of different shapes (``tiny-llama``, ``tiny-llama-bf16``,
``tiny-llama-deep``) behind one router, two arms in one run, the same seeded workloads:

* **static** — native vLLM (no elastickv), each engine's KV cache fixed at B/3
  (``elastickv serve`` in ``mode = "static"``: the same router, so only memory differs);
* **elastic** — ``elastickv serve``: the engines share B by demand, idle models release their
  KV and long-idle ones stop.

Workloads (seeded; prompts of ``--prompt`` token ids, outputs 32–64 tokens, ``ignore_eos``):
``ramp`` (kvcached's staggered ramp 1 → P → 1 req/s, models ``P/4 + 2P`` s apart),
``correlated`` (two models ramp together), ``idle`` (bursts separated by gaps longer than
the idle tier's time: a wake). Reported per model and arm: TTFT mean/p50/p99, end to end,
time per output token, failures, vLLM preemptions and peak waiting requests (scraped from
each engine), wake latency, KV memory-seconds; and static/elastic ratios. For the idle
workload also the TTFT of the first request after each gap and the engines' resident
memory-seconds (PSS). ``--tier`` chooses what an idle elastic model comes to: ``stop`` (its
engine stops after 90 s) or ``asleep`` (its weights sleep after 30 s, its engine stays).
The regime is proven from the static arm's own counters: it must preempt or queue for the
comparison to mean anything, and the report says so when it did not.

With ``--repeat N`` both arms run N times (fresh processes each time, the arm that goes
first alternating) and every static/elastic ratio is reported as the median of the N runs
with a bootstrap interval (one run on two cores moves a p99 ratio by half); the JSON carries
each run's report.

With ``--sweep`` it answers the capacity question instead: for each arm, the smallest budget
at which the ramp meets a TTFT p99 target with no failure (each budget judged by the median
of ``--repeat`` runs, found by doubling then geometric bisection: ``elastickv.bench.sweep``),
and B_static / B_elastic with the interval the two brackets leave.

With ``--fit`` it answers how many models fit one device: at ``--budget`` (8M), the most
models each arm serves on the ramp within the same target (the three shapes cycled under
names of their own: ``tiny-llama-2`` is the fourth; the static arm splits B by the count),
found from three models up by three while the target is met, down by one while it is
missed, then by bisection.

    .venv/bin/python benchmarks/bench_serve.py [--json] [--plot FILE.png]
        [--workloads ramp,correlated,idle] [--peak 12] [--budget 4992K] [--quick]
        [--repeat N] [--min-kv request|floor] [--tier stop|asleep]
    .venv/bin/python benchmarks/bench_serve.py --sweep [--slo 1.0] [--repeat 3]
        [--resolution 1.2] [--sweep-max 48M] [--arms static,elastic] [--json] [--plot F]
    .venv/bin/python benchmarks/bench_serve.py --fit [--budget 8M] [--slo 1.0] [--repeat 3]
        [--fit-max 12] [--arms static,elastic] [--min-kv request|floor] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from elastickv.bench.client import Result, run_schedule
from elastickv.bench.monitor import Monitor, serve_ready
from elastickv.bench.plot import plot_run, plot_sweep
from elastickv.bench.repeats import RATIOS, over_runs
from elastickv.bench.stats import after_idle, latency_summary, memory_seconds, per_model, ratio
from elastickv.bench.sweep import (
    Point,
    Search,
    Trial,
    capacity_ratio,
    judge,
    largest_passing,
    smallest_passing,
)
from elastickv.bench.workloads import (
    Shape,
    correlated_burst,
    idle_gaps,
    ramp_gap,
    staggered_ramp,
)
from elastickv.integrations.vllm.worker.capacity import page_aligned_blocks
from elastickv.models import get_builtin_model
from elastickv.ports import free_port
from elastickv.serve.engine import stop_session
from elastickv.serve.python_env import find_engine_python
from elastickv.units import format_bytes, parse_size

SHAPES = ("tiny-llama", "tiny-llama-bf16", "tiny-llama-deep")
MAX_MODEL_LEN, BLOCK_SIZE = 384, 32
ENGINE_ARGS = [
    "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE)
]  # fmt: skip
PAGE = "64K"
PAGE_BYTES = parse_size(PAGE)
# Guaranteed KV per model (by shape), ``--min-kv``: ``request``, at least one max-length
# request each (384 tokens × 1, 2.25 and 4 KiB per token), so every model can always make
# progress; ``floor``, the least an engine starts with, its null block's pages (one per layer
# in these layer-major layouts): a model then waits for room the others hold instead of
# always having one request's worth, and B is about the working set.
MIN_KV_CHOICES = {
    "request": {"tiny-llama": 512 << 10, "tiny-llama-bf16": 1 << 20, "tiny-llama-deep": 1536 << 10},
    "floor": {m: get_builtin_model(m).num_hidden_layers * PAGE_BYTES for m in SHAPES},
}
RELEASE_AFTER_S = 5
# Longer than any of three models waits for its burst in a ramp (2 × (P/4 + 2P) s: 54 s at
# P = 12), so the ramp measures memory, not engine start-ups; the idle workload's gaps are
# longer still. Each model beyond three adds one ramp gap (:meth:`Fleet.stop_after_s`).
STOP_AFTER_S = 90
IDLE_GAP_S = 100
# ``--tier asleep``: idle this long, an elastic model's weights sleep (its engine is never
# stopped); shorter than the idle workload's gaps, longer than two ramp gaps at P = 12.
SLEEP_AFTER_S = 30
TIERS = ("stop", "asleep")
TIER_MEANING = {
    "stop": f"its engine stopped (after {STOP_AFTER_S} s idle)",
    "asleep": f"its weights asleep (after {SLEEP_AFTER_S} s idle; its engine never stopped)",
}
TARGET_P99, TARGET_MEAN = 2.0, 1.25
# The static arm is memory-bound if it preempted, was seen with waiting requests, or its
# requests waited in vLLM's queue this long on average (a tiny model's step takes a few ms:
# a longer wait means no KV room; the waiting gauge is only sampled once a second).
QUEUED_MEAN_S = 0.02
# ``--fit``'s default budget: two of the three shapes fit its static split with room to
# spare (4 MiB each); three do not meet the target (2.7 MiB each, below the 3.25 MiB the
# sweep saw miss).
FIT_BUDGET = "8M"


def static_floor(shape: str) -> int:
    """The KV cache native vLLM needs to start a model of ``shape`` (each runs in its own
    dtype): one max-length request's blocks plus the null block vLLM keeps for itself."""
    blocks = -(-MAX_MODEL_LEN // BLOCK_SIZE) + 1
    return blocks * BLOCK_SIZE * get_builtin_model(shape).kv_bytes_per_token


def elastic_floor(shape: str) -> int:
    """The virtual capacity an elastic engine needs to start a model of ``shape``: the static
    floor's blocks rounded up to a count whose bytes fill whole pages in every layer
    (elastickv advertises such counts: the float32 deep model's layers take 32 KiB a block,
    so its 13 blocks become 14 on 64 KiB pages)."""
    spec = get_builtin_model(shape)
    block = BLOCK_SIZE * spec.kv_bytes_per_token
    layers = [block // spec.num_hidden_layers] * spec.num_hidden_layers
    align = page_aligned_blocks(layers, PAGE_BYTES)
    blocks = static_floor(shape) // block
    return -(-blocks // align) * align * block


@dataclass(frozen=True)
class Fleet:
    """The models one ``elastickv serve`` runs: ``count`` of them, the built-in shapes cycled
    (the fourth is ``tiny-llama-2``, a second ``tiny-llama`` under its own name), each elastic
    one guaranteed its shape's ``min_kv`` (a :data:`MIN_KV_CHOICES` key)."""

    count: int = len(SHAPES)
    min_kv: str = "request"
    tier: str = "stop"  # what an idle elastic model comes to: a :data:`TIERS` name

    @property
    def shapes(self) -> dict[str, str]:
        """Served name -> built-in shape."""
        found = {}
        for index in range(self.count):
            shape = SHAPES[index % len(SHAPES)]
            lap = index // len(SHAPES)
            found[shape if lap == 0 else f"{shape}-{lap + 1}"] = shape
        return found

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.shapes)

    @property
    def min_kv_bytes(self) -> dict[str, int]:
        floors = MIN_KV_CHOICES[self.min_kv]
        return {name: floors[shape] for name, shape in self.shapes.items()}

    def stop_after_s(self, peak: int) -> int:
        """Idle seconds before serve stops an engine: :data:`STOP_AFTER_S`, and one ramp gap
        more for every model beyond three (the last model's burst comes that much later)."""
        return STOP_AFTER_S + max(0, self.count - len(SHAPES)) * math.ceil(ramp_gap(peak))

    def smallest_static_budget(self) -> int:
        """The smallest B whose static split (B / count each) starts every model: 4992 KiB
        for the three shapes, the float32 ``tiny-llama-deep``'s 13 blocks of 128 KiB three
        times."""
        return max(map(static_floor, self.shapes.values())) * self.count

    def smallest_elastic_budget(self) -> int:
        """The smallest B ``elastickv serve`` starts these models with: every ``min_kv``, and
        each engine's capacity (B less the others' ``min_kv``) its :func:`elastic_floor`
        (3328 KiB for the three shapes: the deep model's 1792K beside the other two floors;
        2112K with ``floor``)."""
        min_kv = self.min_kv_bytes
        floors = sum(min_kv.values())
        need = max(elastic_floor(s) + floors - min_kv[n] for n, s in self.shapes.items())
        return -(-max(floors, need) // PAGE_BYTES) * PAGE_BYTES

    def static_error(self, budget: int) -> str | None:
        """Why the static arm could not start under ``budget`` (None: it can)."""
        share = budget // self.count
        for name, shape in self.shapes.items():
            need = static_floor(shape)
            if share < need:
                return (
                    f"--budget {budget // 1024}K: the static arm gives each of the {self.count} "
                    f"models {share // 1024}K, and {name} needs {need // 1024}K to start (one "
                    f"{MAX_MODEL_LEN}-token request and vLLM's null block); use --budget "
                    f"{self.smallest_static_budget() // 1024}K or more"
                )
        return None

    def starts(self, mode: str, budget: int) -> bool:
        """Whether ``mode``'s arm starts every model under ``budget``."""
        if mode == "static":
            return self.static_error(budget) is None
        return self.smallest_elastic_budget() <= budget


MODELS = Fleet().names


def config_text(
    mode: str, budget: int, port: int, log_dir: Path, fleet: Fleet = Fleet(), peak: int = 12
) -> str:
    lines = [
        f'python = "{find_engine_python()}"',
        f'log_dir = "{log_dir}"',
        "[router]",
        f"port = {port}",
        "queue_limit = 1024",
        "[device]",
        f"budget = {budget}",
        f'page_size = "{PAGE}"',
        f'mode = "{mode}"',
    ]
    min_kv = fleet.min_kv_bytes
    for name, shape in fleet.shapes.items():
        lines += [
            "[[model]]",
            f'name = "{name}"',
            f'model = "{shape}"',
            f"args = {json.dumps(ENGINE_ARGS)}",
            f"min_kv = {min_kv[name]}",
            f'release_after = "{RELEASE_AFTER_S}s"',
            *idle_tiers(fleet, peak),
        ]
    return "\n".join(lines) + "\n"


def idle_tiers(fleet: Fleet, peak: int) -> list[str]:
    """The elastic arm's idle tiers after the KV release: its engine stopped, or its weights
    asleep (then never stopped)."""
    if fleet.tier == "asleep":
        return [f'sleep_after = "{SLEEP_AFTER_S}s"', 'stop_after = "never"']
    return ['sleep_after = "never"', f'stop_after = "{fleet.stop_after_s(peak)}s"']


class ArmStartError(RuntimeError):
    """An arm's ``elastickv serve`` did not become ready (its log's tail is the message)."""


@contextlib.contextmanager
def serve(mode: str, budget: int, work: Path, fleet: Fleet, peak: int) -> Iterator[str]:
    """``elastickv serve`` for one arm, in its own session; yields the router URL."""
    port = free_port()
    config = work / f"{mode}.toml"
    config.write_text(config_text(mode, budget, port, work / f"{mode}-logs", fleet, peak))
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(work / "vllm-cache"),
        ELASTICKV_LEDGER_DIR=str(work / f"{mode}-ledger"),
    )
    log = work / f"{mode}-serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastickv.cli.main", "serve", "--config", str(config)],
            env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while not serve_ready(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ArmStartError(f"{mode} arm did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield base
    finally:
        stop_session(proc, timeout=90)


async def drive(
    base: str, arrivals: list[Any], names: tuple[str, ...]
) -> tuple[list[Result], Monitor, float]:
    monitor = Monitor(base, names)
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        watch = asyncio.create_task(monitor.run(session, start))
        try:
            results = await run_schedule(base, arrivals)
            await asyncio.sleep(1.0)
        finally:
            watch.cancel()
    return results, monitor, time.monotonic() - start


async def wake_latency(base: str) -> dict[str, float | None]:
    """Mean wake latency per model and tier from the router's own histogram."""
    async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as response:
        text = await response.text()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        found = re.match(
            r'elastickv_router_wake_seconds_(sum|count)\{model="([^"]+)",tier="(\w+)"\} (\S+)', line
        )
        if found:
            kind, model, tier, value = found.groups()
            bucket = sums if kind == "sum" else counts
            bucket[f"{model}/{tier}"] = float(value)
    return {k: sums[k] / counts[k] if counts.get(k) else None for k in sums}


def workloads(names: list[str], peak: int, shape: Shape) -> dict[str, list[Any]]:
    table = {
        "ramp": lambda: staggered_ramp(MODELS, peak, shape=shape, seed=1),
        "correlated": lambda: correlated_burst(MODELS, peak, shape=shape, seed=2),
        "idle": lambda: idle_gaps(MODELS, max(2, peak // 2), gap=IDLE_GAP_S, shape=shape, seed=3),
    }
    return {name: table[name]() for name in names}


def run_arm(
    mode: str, budget: int, work: Path, plan: dict[str, list[Any]], fleet: Fleet, peak: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    started = time.monotonic()
    with serve(mode, budget, work, fleet, peak) as base:
        out["startup_s"] = round(time.monotonic() - started, 1)
        for name, arrivals in plan.items():
            print(f"  {mode}: workload {name} ({len(arrivals)} requests)", file=sys.stderr)
            results, monitor, seconds = asyncio.run(drive(base, arrivals, fleet.names))
            out[name] = {
                "seconds": round(seconds, 1),
                "results": results,
                "memory": monitor.memory,
                "summary": per_model(results, fleet.names),
                "preemptions": monitor.preemptions,
                "max_waiting": monitor.max_waiting,
                "queue_s": monitor.queue_s,
                "states": {m: sorted(s) for m, s in monitor.states.items()},
                "memory_gib_s": memory_seconds(monitor.memory),
                "resident_gib_s": memory_seconds(monitor.resident),
                "after_idle": latency_summary(after_idle(results, IDLE_GAP_S / 2)),
                "peak_total_bytes": max((sum(s.values()) for _, s in monitor.memory), default=0),
            }
        out["wake_latency_s"] = asyncio.run(wake_latency(base))
    return out


def report(
    static: dict[str, Any], elastic: dict[str, Any], names: list[str], budget: int
) -> dict[str, Any]:
    doc: dict[str, Any] = {"budget_bytes": budget, "models": list(MODELS), "workloads": {}}
    for name in names:
        s, e = static[name], elastic[name]
        requests = max(1, s["summary"]["all"]["requests"])
        queued_mean = sum(s["queue_s"].values()) / requests
        regime = (
            sum(s["preemptions"].values()) > 0
            or max(s["max_waiting"].values()) > 0
            or queued_mean >= QUEUED_MEAN_S
        )
        rows = {}
        for model in [*MODELS, "all"]:
            ss, es = s["summary"][model], e["summary"][model]
            rows[model] = {
                "static": ss,
                "elastic": es,
                "ratio_ttft_mean": ratio(ss["ttft_mean"], es["ttft_mean"]),
                "ratio_ttft_p99": ratio(ss["ttft_p99"], es["ttft_p99"]),
                "ratio_e2e_mean": ratio(ss["e2e_mean"], es["e2e_mean"]),
            }
        doc["workloads"][name] = {
            "models": rows,
            "memory_bound_in_static": regime,
            "static_preemptions": s["preemptions"],
            "static_max_waiting": s["max_waiting"],
            "static_queue_s": s["queue_s"],
            "elastic_preemptions": e["preemptions"],
            "elastic_max_waiting": e["max_waiting"],
            "elastic_queue_s": e["queue_s"],
            "elastic_states_seen": e["states"],
            "memory_gib_s": {"static": s["memory_gib_s"], "elastic": e["memory_gib_s"]},
            "resident_gib_s": {"static": s["resident_gib_s"], "elastic": e["resident_gib_s"]},
            "after_idle": {"static": s["after_idle"], "elastic": e["after_idle"]},
            "peak_total_bytes": {"static": s["peak_total_bytes"], "elastic": e["peak_total_bytes"]},
            "failed": {
                "static": s["summary"]["all"]["failed"],
                "elastic": e["summary"]["all"]["failed"],
            },
        }
    doc["startup_s"] = {"static": static["startup_s"], "elastic": elastic["startup_s"]}
    doc["wake_latency_s"] = elastic["wake_latency_s"]
    ramp = doc["workloads"].get("ramp")
    if ramp:
        allm = ramp["models"]["all"]
        doc["target"] = {
            "p99_ttft_ratio": allm["ratio_ttft_p99"],
            "mean_ttft_ratio": allm["ratio_ttft_mean"],
            "met": bool(
                (allm["ratio_ttft_p99"] or 0) >= TARGET_P99
                and (allm["ratio_ttft_mean"] or 0) >= TARGET_MEAN
                and ramp["failed"]["elastic"] == 0
            ),
        }
    return doc


def trial(
    mode: str, budget: int, fleet: Fleet, args: argparse.Namespace, runs: list[dict[str, Any]]
) -> Trial:
    """One run of ``mode`` with ``fleet`` under ``budget`` on the ramp (a fresh ``elastickv
    serve``), its summary appended to ``runs``; an arm that cannot start misses."""
    plan = {"ramp": ramp_plan(fleet, args)}
    where = f"{mode} with {fleet.count} models at {format_bytes(budget)}"
    try:
        with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
            out = run_arm(mode, budget, Path(tmp), plan, fleet, args.peak)
    except ArmStartError as exc:
        print(f"  {where}: {exc}", file=sys.stderr)
        runs.append({
            "arm": mode, "budget_bytes": budget, "models": fleet.count,
            "start_error": str(exc)[-600:],
        })  # fmt: skip
        return Trial(None, len(plan["ramp"]))
    summary = out["ramp"]["summary"]
    found = Trial(summary["all"]["ttft_p99"], summary["all"]["failed"])
    runs.append({
        "arm": mode,
        "budget_bytes": budget,
        "models": fleet.count,
        "startup_s": out["startup_s"],
        "ttft_p99_s": {m: summary[m]["ttft_p99"] for m in [*fleet.names, "all"]},
        "ttft_mean_s": summary["all"]["ttft_mean"],
        "failed": found.failed,
        "preemptions": out["ramp"]["preemptions"],
        "max_waiting": out["ramp"]["max_waiting"],
        "peak_total_bytes": out["ramp"]["peak_total_bytes"],
    })  # fmt: skip
    verdict = "meets" if found.passes(args.slo) else "misses"
    print(
        f"  {where}: TTFT p99 {_fmt(found.ttft_p99)}, {found.failed} failed: {verdict} the target",
        file=sys.stderr,
    )
    return found


def ramp_plan(fleet: Fleet, args: argparse.Namespace) -> list[Any]:
    """The sweep's and the fit's workload: the staggered ramp over ``fleet``'s models."""
    return staggered_ramp(fleet.names, args.peak, shape=Shape(prompt_tokens=args.prompt), seed=1)


def workload_json(args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(prompt_tokens=args.prompt)
    return {
        "name": "ramp", "peak": args.peak, "prompt_tokens": shape.prompt_tokens,
        "output_tokens": [shape.min_output, shape.max_output],
        "requests_per_model": len(ramp_plan(Fleet(1), args)),
        "model_gap_s": ramp_gap(args.peak),
    }  # fmt: skip


def sweep_arm(
    mode: str, fleet: Fleet, low: int, args: argparse.Namespace, runs: list[dict[str, Any]]
) -> Search:
    """The smallest budget at which ``mode`` meets the target with ``fleet``."""
    step = PAGE_BYTES * (fleet.count if mode == "static" else 1)
    high = max(low, -(-args.sweep_max // step) * step)

    def judge_at(budget: int) -> Point:
        return judge(lambda b: trial(mode, b, fleet, args, runs), budget, args.repeat, args.slo)

    return smallest_passing(judge_at, low, high, step, args.resolution)


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """``--sweep``: B_static and B_elastic for the target, and their ratio."""
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    fleet = Fleet(min_kv=args.min_kv)
    lows = {"static": fleet.smallest_static_budget(), "elastic": fleet.smallest_elastic_budget()}
    searches = {mode: sweep_arm(mode, fleet, lows[mode], args, runs) for mode in args.arms}
    return {
        "sweep": {
            "target": {"ttft_p99_s": args.slo, "failed": 0},
            "workload": {
                **workload_json(args),
                "requests": len(ramp_plan(fleet, args)),
                "models": list(fleet.names),
            },
            "repeats": args.repeat,
            "resolution": args.resolution,
            "arms": {
                mode: {"search_from_bytes": lows[mode], **search.as_json()}
                for mode, search in searches.items()
            },
            "elastic_min_kv_bytes": fleet.min_kv_bytes,
            "capacity_ratio": (
                capacity_ratio(searches["static"], searches["elastic"])
                if len(searches) == 2
                else {"ratio": None, "low": None, "high": None}
            ),
            "seconds": round(time.monotonic() - started),
            "runs": runs,
        }
    }  # fmt: skip


def most_startable(mode: str, args: argparse.Namespace) -> int:
    """The most models, up to ``--fit-max``, ``mode``'s arm starts under ``--budget``
    (fewer models never need more to start)."""
    count = 0
    while count < args.fit_max and Fleet(count + 1, args.min_kv).starts(mode, args.budget):
        count += 1
    return count


def fit_arm(mode: str, args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The most models ``mode`` serves within the target under ``--budget``, and what
    bounds it: the target, the budget (no more models start) or ``--fit-max``."""
    high = most_startable(mode, args)  # at least 1: fit_errors refused a budget starting none

    def judge_at(count: int) -> Point:
        fleet = Fleet(count, args.min_kv)
        return judge(
            lambda n: trial(mode, args.budget, fleet, args, runs), count, args.repeat, args.slo
        )

    search = largest_passing(judge_at, min(len(SHAPES), high), high, len(SHAPES))
    if search.smallest_failing is not None:
        limited_by = "target"
    elif Fleet(high + 1, args.min_kv).starts(mode, args.budget):
        limited_by = "fit-max"
    else:
        limited_by = "start"
    return {"most_startable": high, "limited_by": limited_by, **search.as_json()}


def fit(args: argparse.Namespace) -> dict[str, Any]:
    """``--fit``: at ``--budget``, the most models each arm serves within the target."""
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    arms = {mode: fit_arm(mode, args, runs) for mode in args.arms}
    most = {mode: arm["largest_passing_models"] for mode, arm in arms.items()}
    static, elastic = most.get("static"), most.get("elastic")
    return {
        "fit": {
            "budget_bytes": args.budget,
            "target": {"ttft_p99_s": args.slo, "failed": 0},
            "workload": {**workload_json(args), "shapes": list(SHAPES)},
            "repeats": args.repeat,
            "elastic_min_kv": args.min_kv,
            "arms": arms,
            "models_ratio": elastic / static if static and elastic else None,
            "seconds": round(time.monotonic() - started),
            "runs": runs,
        }
    }


def print_point(label: str, point: dict[str, Any]) -> None:
    """One budget or count tried: its verdict, the median and every run."""
    each = ", ".join(
        _fmt(p) + (f" ({f} failed)" if f else "")
        for p, f in zip(point["ttft_p99_s"], point["failed"], strict=True)
    )
    verdict = "meets" if point["passed"] else "misses"
    print(
        f"   {label}: {verdict}, median TTFT p99 {_fmt(point['median_ttft_p99_s'])} (runs: {each})"
    )


def print_sweep(doc: dict[str, Any]) -> None:
    found = doc["sweep"]
    target, workload = found["target"], found["workload"]
    print(
        f"target: TTFT p99 <= {target['ttft_p99_s']} s over all models, 0 failed; workload "
        f"{workload['name']} at P = {workload['peak']} ({workload['requests']} requests); "
        f"each budget judged by the median of {found['repeats']} runs"
    )
    for mode, arm in found["arms"].items():
        print(f"\n== {mode}")
        for point in arm["points"]:
            print_point(f"{format_bytes(point['budget_bytes']):>10}", point)
        smallest = arm["smallest_passing_bytes"]
        print(
            f"   smallest budget meeting the target: "
            f"{format_bytes(smallest) if smallest else 'none in the range'}"
            + (
                f" (misses at {format_bytes(arm['largest_failing_bytes'])})"
                if arm["largest_failing_bytes"]
                else ""
            )
        )
    ratio_ = found["capacity_ratio"]
    if len(found["arms"]) < 2:
        print(f"\none arm searched; {found['seconds'] / 60:.0f} min")
    elif ratio_["ratio"] is None:
        print("\nB_static / B_elastic: - (an arm never met the target in its range)")
    else:
        print(
            f"\nB_static / B_elastic = {ratio_['ratio']:.2f} (interval the brackets leave: "
            f"{ratio_['low']:.2f} to {ratio_['high']:.2f}); {found['seconds'] / 60:.0f} min"
        )


def print_fit(doc: dict[str, Any]) -> None:
    found = doc["fit"]
    target, workload = found["target"], found["workload"]
    print(
        f"at B = {format_bytes(found['budget_bytes'])}: target TTFT p99 <= "
        f"{target['ttft_p99_s']} s over all models, 0 failed; ramp at P = {workload['peak']} "
        f"({workload['requests_per_model']} requests a model, {', '.join(workload['shapes'])} "
        f"cycled); each count judged by the median of {found['repeats']} runs"
    )
    bounds = {
        "target": "one more misses the target",
        "start": "no more start under B",
        "fit-max": "--fit-max reached",
    }
    for mode, arm in found["arms"].items():
        print(f"\n== {mode}")
        for point in arm["points"]:
            print_point(f"{point['models']:>3} models", point)
        most = arm["largest_passing_models"]
        print(f"   most models meeting the target: {most or 0} ({bounds[arm['limited_by']]})")
    models_ratio = found["models_ratio"]
    print(
        "\nmodels elastic / static: "
        + ("-" if models_ratio is None else f"{models_ratio:.2f}")
        + f"; {found['seconds'] / 60:.0f} min"
    )


def print_over_runs(doc: dict[str, Any]) -> None:
    print(f"\n== ratios over {doc['repeats']} runs (static / elastic): median [bootstrap 95 %]")
    for name, models in doc["ratios"].items():
        for model, row in models.items():
            cells = []
            for key in RATIOS:
                found = row[key]
                label = key.removeprefix("ratio_")
                if found["median"] is None:
                    cells.append(f"{label} -")
                    continue
                runs = ", ".join("-" if v is None else f"{v:.2f}" for v in found["runs"])
                cells.append(
                    f"{label} {found['median']:.2f}x [{found['low']:.2f}, {found['high']:.2f}]"
                    f" ({runs})"
                )
            print(f"   {name:10} {model:16} " + "; ".join(cells))
    if "target" in doc:
        t = doc["target"]
        print(
            f"target on ramp, medians (p99 ratio >= {TARGET_P99}, mean >= {TARGET_MEAN}, 0 "
            f"failed in every run): {'met' if t['met'] else 'missed'} (p99 "
            f"{t['p99_ttft_ratio']}, mean {t['mean_ttft_ratio']}, elastic failures "
            f"{t['elastic_failed']})"
        )


def _fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if unit == "s" and value < 10 else f"{value:.2f}{unit}"


def print_table(doc: dict[str, Any]) -> None:
    print(f"KV budget B = {format_bytes(doc['budget_bytes'])} shared by {', '.join(doc['models'])}")
    print(
        f"start-up: static {doc['startup_s']['static']} s, elastic {doc['startup_s']['elastic']} s"
    )
    if "tier" in doc:
        print(f"an idle elastic model comes to: {TIER_MEANING[doc['tier']]}")
    for name, w in doc["workloads"].items():
        regime = (
            "memory-bound in the static arm"
            if w["memory_bound_in_static"]
            else (
                "NOT memory-bound in the static arm (no preemption, no waiting, short queues): "
                "the comparison shows no memory effect"
            )
        )
        print(f"\n== {name}: {regime}")
        print(f"   static preemptions {w['static_preemptions']}")
        print(f"   static max waiting {w['static_max_waiting']}")
        queued = {m: round(v, 2) for m, v in w["static_queue_s"].items()}
        print(f"   static seconds queued in vLLM {queued}")
        print(f"   failed: static {w['failed']['static']}, elastic {w['failed']['elastic']}")
        header = (
            f"   {'model':16} {'TTFT mean s/e':>18} {'ratio':>6} {'TTFT p99 s/e':>18} "
            f"{'ratio':>6} {'e2e mean s/e':>18} {'TPOT s/e':>14} {'GiB·s s/e':>14}"
        )
        print(header)
        for model, row in w["models"].items():
            s, e = row["static"], row["elastic"]
            mem = w["memory_gib_s"]
            ms = (
                f"{mem['static'].get(model, 0):.3f}/{mem['elastic'].get(model, 0):.3f}"
                if model != "all"
                else (f"{sum(mem['static'].values()):.3f}/{sum(mem['elastic'].values()):.3f}")
            )
            r1, r2 = row["ratio_ttft_mean"], row["ratio_ttft_p99"]
            print(
                f"   {model:16} {_fmt(s['ttft_mean']) + '/' + _fmt(e['ttft_mean']):>18} "
                f"{(f'{r1:.2f}x' if r1 else '-'):>6} "
                f"{_fmt(s['ttft_p99']) + '/' + _fmt(e['ttft_p99']):>18} "
                f"{(f'{r2:.2f}x' if r2 else '-'):>6} "
                f"{_fmt(s['e2e_mean']) + '/' + _fmt(e['e2e_mean']):>18} "
                f"{_fmt(s['tpot_mean']) + '/' + _fmt(e['tpot_mean']):>14} {ms:>14}"
            )
        print_after_idle(w)
    if "target" in doc:
        t = doc["target"]
        print(
            f"\ntarget on ramp (p99 ratio >= {TARGET_P99}, mean >= {TARGET_MEAN}, 0 failed): "
            f"{'met' if t['met'] else 'missed'} "
            f"(p99 {t['p99_ttft_ratio']}, mean {t['mean_ttft_ratio']})"
        )
    print(f"wake latency (elastic, mean s by model/tier): {doc['wake_latency_s']}")


def print_after_idle(workload: dict[str, Any]) -> None:
    """A workload's first requests after an idle gap, and the engines' resident memory."""
    after = workload.get("after_idle")
    if not after or not after["elastic"]["requests"]:
        return
    s, e = after["static"], after["elastic"]
    resident = {arm: sum(v.values()) for arm, v in workload["resident_gib_s"].items()}
    print(
        f"   first request after an idle gap ({e['requests']}): TTFT mean "
        f"{_fmt(s['ttft_mean'])}/{_fmt(e['ttft_mean'])}, p99 "
        f"{_fmt(s['ttft_p99'])}/{_fmt(e['ttft_p99'])} (static/elastic)"
    )
    print(
        f"   engines' resident memory (PSS) {resident['static']:.1f}/{resident['elastic']:.1f} "
        "GiB·s (static/elastic)"
    )


def search_errors(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a sweep's or a fit's bad options before anything starts."""
    flag = "--sweep" if args.sweep else "--fit"
    if args.sweep and args.fit:
        parser.error("--sweep and --fit exclude each other: run them one after the other")
    if args.repeat % 2 == 0:
        parser.error(f"--repeat must be odd with {flag} (a median of runs), got {args.repeat}")
    if args.slo <= 0:
        parser.error(f"--slo must be a positive number of seconds, got {args.slo}")
    args.arms = [a.strip() for a in (args.arms or "static,elastic").split(",") if a.strip()]
    if (
        not args.arms
        or set(args.arms) - {"static", "elastic"}
        or len(set(args.arms)) < len(args.arms)
    ):
        parser.error(f"--arms takes static, elastic or both, got {','.join(args.arms)!r}")
    if args.fit:
        fit_errors(parser, args)
        return
    if args.resolution <= 1:
        parser.error(f"--resolution must be above 1, got {args.resolution}")
    if args.budget is not None:
        parser.error("--budget and --sweep exclude each other: the sweep chooses the budgets")
    try:
        args.sweep_max = parse_size(args.sweep_max)
    except ValueError as exc:
        parser.error(f"--sweep-max: {exc}")
    if args.sweep_max < Fleet().smallest_static_budget():
        parser.error(
            f"--sweep-max {args.sweep_max // 1024}K is below the smallest budget the static "
            f"arm starts with, {Fleet().smallest_static_budget() // 1024}K"
        )


def fit_errors(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--fit``: the budget parses and one model of each arm starts under it."""
    if args.plot is not None:
        parser.error("--fit draws no picture: its answer is a count per arm (drop --plot)")
    if args.fit_max < 1:
        parser.error(f"--fit-max must be at least 1, got {args.fit_max}")
    try:
        args.budget = parse_size(args.budget or FIT_BUDGET)
    except ValueError as exc:
        parser.error(f"--budget: {exc}")
    for mode in args.arms:
        if not Fleet(1, args.min_kv).starts(mode, args.budget):
            parser.error(
                f"--budget {args.budget // 1024}K starts no model in the {mode} arm; use "
                f"{FIT_BUDGET} or more"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, help="write the picture of the ramp workload (PNG)")
    parser.add_argument("--workloads", default="ramp,correlated,idle")
    parser.add_argument("--peak", type=int, default=12, help="P: peak requests/s of a ramp")
    parser.add_argument(
        "--budget",
        help="B, the KV bytes the models share (default: the smallest whose static split "
        f"starts every model, {Fleet().smallest_static_budget() // 1024}K; with --fit "
        f"{FIT_BUDGET})",
    )
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--quick", action="store_true", help="the ramp workload only")
    parser.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help="run both arms N times; ratios as the median of the runs with a bootstrap "
        "interval (1); with --sweep or --fit, the runs that judge each point (odd, 3)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="find each arm's smallest budget meeting the target on the ramp, and their ratio",
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="at --budget, find the most models (the three shapes cycled) each arm serves "
        "meeting the target on the ramp",
    )
    parser.add_argument(
        "--slo",
        type=float,
        default=1.0,
        help="--sweep's and --fit's target: TTFT p99 in seconds (1.0)",
    )
    parser.add_argument(
        "--sweep-max", default="48M", help="--sweep's largest budget tried per arm (48M)"
    )
    parser.add_argument(
        "--fit-max", type=int, default=12, help="--fit's largest number of models tried (12)"
    )
    parser.add_argument(
        "--min-kv",
        choices=sorted(MIN_KV_CHOICES),
        default="request",
        help="each model's min_kv in the elastic arm: one max-length request's blocks "
        "(request, default) or the least its engine starts with, its null block's pages "
        "(floor)",
    )
    parser.add_argument(
        "--tier",
        choices=TIERS,
        default="stop",
        help=f"what an idle elastic model comes to: its engine stopped after {STOP_AFTER_S} s "
        f"(stop, default) or its weights asleep after {SLEEP_AFTER_S} s (asleep)",
    )
    parser.add_argument(
        "--arms",
        help="--sweep's or --fit's arms, searched in this order (static,elastic)",
    )
    parser.add_argument(
        "--resolution",
        type=float,
        default=1.2,
        help="--sweep stops when the smallest passing budget is within this factor of the "
        "largest failing one (1.2)",
    )
    args = parser.parse_args()
    searching = args.sweep or args.fit
    if args.repeat is None:
        args.repeat = 3 if searching else 1
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    names = ["ramp"] if args.quick else [w.strip() for w in args.workloads.split(",") if w.strip()]
    if searching:
        names = ["ramp"]
    unknown = set(names) - {"ramp", "correlated", "idle"}
    if unknown:
        parser.error(
            f"unknown workload(s) {', '.join(sorted(unknown))}; use ramp, correlated, idle"
        )
    if searching:
        search_errors(parser, args)
    elif args.arms is not None:
        parser.error("--arms chooses the arms of --sweep or --fit; a comparison runs both")
    else:
        try:
            args.budget = (
                Fleet().smallest_static_budget() if args.budget is None else parse_size(args.budget)
            )
        except ValueError as exc:
            parser.error(f"--budget: {exc}")
        if (why := Fleet().static_error(args.budget)) is not None:
            parser.error(why)
    try:
        if args.sweep:
            run_sweep(args)
        elif args.fit:
            found = fit(args)
            if args.json:
                print(json.dumps(found))
            else:
                print_fit(found)
        else:
            compare(args, names, workloads(names, args.peak, Shape(prompt_tokens=args.prompt)))
    except ArmStartError as exc:
        raise SystemExit(str(exc)) from None


def run_sweep(args: argparse.Namespace) -> None:
    found = sweep(args)
    if args.plot:
        found["sweep"]["plot"] = str(args.plot)
    if args.json:
        print(json.dumps(found), flush=True)
    else:
        print_sweep(found)
    if args.plot:  # after the numbers: a missing matplotlib costs the picture only
        plot_sweep(args.plot, found["sweep"])


def compare(args: argparse.Namespace, names: list[str], plan: dict[str, list[Any]]) -> None:
    """Both arms at one budget, ``--repeat`` times, and their ratios."""
    budget = args.budget
    fleet = Fleet(min_kv=args.min_kv, tier=args.tier)
    runs: list[dict[str, Any]] = []
    arms: dict[str, dict[str, Any]] = {}
    for index in range(args.repeat):
        if args.repeat > 1:
            print(f"run {index + 1} of {args.repeat}", file=sys.stderr)
        order = ("static", "elastic") if index % 2 == 0 else ("elastic", "static")
        with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
            done = {
                mode: run_arm(mode, budget, Path(tmp), plan, fleet, args.peak) for mode in order
            }
        arms = arms or done  # the first run's arms are the ones plotted
        runs.append({**report(done["static"], done["elastic"], names, budget), "tier": args.tier})
    static, elastic = arms["static"], arms["elastic"]
    doc = (
        runs[0]
        if args.repeat == 1
        else {
            **runs[0],
            **over_runs(runs, TARGET_P99, TARGET_MEAN),
            "runs": runs,
        }
    )
    if args.plot:  # after the report: a missing matplotlib costs the picture, not the numbers
        chosen = names[0]
        plot_run(
            args.plot,
            {
                "static (B/3 each, native vLLM)": static[chosen],
                "elastic (elastickv serve)": elastic[chosen],
            },
            MODELS,
            budget,
            f"workload {chosen}: {len(plan[chosen])} requests, B = {format_bytes(budget)}",
        )
        doc["plot"] = str(args.plot)
    if args.json:
        print(json.dumps(doc, default=str))
        return
    for index, run in enumerate(runs):
        if args.repeat > 1:
            print(f"\n######## run {index + 1} of {args.repeat}")
        print_table(run)
    if args.repeat > 1:
        print_over_runs(doc)


if __name__ == "__main__":
    main()
