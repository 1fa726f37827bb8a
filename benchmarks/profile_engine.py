"""Where the engine core's time goes, native vLLM vs elastickv, under the same load (cProfile).

Each side runs in its own process: an in-process vLLM 0.32 engine (``LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so scheduler and model run in that process) on the
built-in tiny model, ``--rounds`` engines per side started in alternating order. After one
untimed warm-up ``generate``, each engine runs the workload ``--repeats`` times without the
profiler (wall and process CPU seconds; wall time per call of ``Scheduler.schedule`` and
``update_from_output``) and as often under cProfile. Reported per scheduler step
(``Scheduler.schedule`` calls), each the fastest of all runs of a side (the machine's load
only ever adds time): the cumulative time of the scheduler's entry points and of the KV-cache
calls elastickv hooks, the model's forward for scale, and the functions with the most own
time in the scheduler's modules (``vllm/v1/core`` and elastickv). Greedy outputs must be
identical on every engine of both sides.

cProfile adds a fixed cost to every Python call, so small functions look bigger than they are;
use the shares to find where the time goes and ``bench_vllm.py`` / ``bench_alloc.py`` for
what it costs.

``--budget B``, as in ``bench_vllm.py``: native vLLM gets a KV cache of B, elastickv a limit of
B (64 KiB pages) under its full virtual cache. The sides then run different numbers of steps
(each preempts in its own way); compare the process CPU and the own-time lists.

    .venvs/vllm-0.32/bin/python benchmarks/profile_engine.py [--concurrency 32] [--json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_vllm import SATURATE_PAGE_BYTES, prompts  # the server benchmark's prompts

from elastickv.bench.vllm_server import (
    add_elastic_env_option,
    elastic_settings,
    hermetic_env,
    ledger_env,
    vllm_version,
)

BLOCK_SIZE = 32
KV_CACHE_BYTES = 64 << 20
# (label, file suffix, function): the scheduler's entry points and the KV-cache calls
# elastickv hooks. A hooked function appears twice (vLLM's and elastickv's wrapper or
# forwarder of the same name); the larger cumulative time, the wrapper's, is the one reported.
ENTRY_POINTS = [
    ("engine step (EngineCore.step)", "v1/engine/core.py", "step"),
    ("Scheduler.schedule", "sched/scheduler.py", "schedule"),
    ("Scheduler.update_from_output", "sched/scheduler.py", "update_from_output"),
    ("KVCacheManager.allocate_slots", "core/kv_cache_manager.py", "allocate_slots"),
    ("KVCacheManager.free", "core/kv_cache_manager.py", "free"),
    ("BlockPool.get_num_free_blocks", "block_pool.py", "get_num_free_blocks"),
    ("BlockPool.get_new_blocks", "block_pool.py", "get_new_blocks"),
    ("BlockPool.free_blocks", "block_pool.py", "free_blocks"),
    ("model forward (execute_model)", "", "execute_model"),
]
HOOK_FILES = ("elastickv/integrations/vllm/scheduler/scheduler_hooks.py",)
FORWARDER_FILE = "<elastickv hook of"  # hooks.compile_hook's generated code
SCHEDULER_MODULES = ("vllm/v1/core/", "elastickv/")


def cumulative(stats: dict[Any, Any], suffix: str, name: str) -> tuple[float, int]:
    """Largest cumulative seconds (and its call count) among functions named ``name`` in a
    file ending with ``suffix`` or in elastickv's scheduler hooks (the wrappers)."""
    best = (0.0, 0)
    for (path, _line, func), (_cc, calls, _tt, ct, _callers) in stats.items():
        if func != name:
            continue
        path = path.replace(os.sep, "/")
        ours = (
            not suffix
            or path.endswith(suffix)
            or path.endswith(HOOK_FILES)
            or path.startswith(FORWARDER_FILE)
        )
        if ours and ct > best[0]:
            best = (ct, calls)
    return best


def top_own_time(stats: dict[Any, Any], top: int) -> list[dict[str, Any]]:
    """The scheduler-module functions with the most own time."""
    rows = []
    for (path, line, func), (_cc, calls, tt, _ct, _callers) in stats.items():
        path = path.replace(os.sep, "/")
        for module in SCHEDULER_MODULES:
            at = path.rfind(module)
            if at >= 0:
                name = f"{path[at:]}:{line}({func})"
                rows.append({"function": name, "calls": calls, "own_s": tt})
                break
    rows.sort(key=lambda row: -float(row["own_s"]))
    return rows[:top]


class StepClock:
    """Wall time per call of one scheduler method, without a profiler (perf_counter_ns)."""

    def __init__(self) -> None:
        self.enabled = True
        self.calls = 0
        self.ns = 0

    def reset(self) -> None:
        self.calls = self.ns = 0

    def per_call_us(self) -> float:
        return self.ns / max(self.calls, 1) / 1e3

    def wrap(self, method: Any) -> Any:
        clock = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return method(*args, **kwargs)
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.ns += clock() - start
                self.calls += 1

        return timed


def install_step_clocks() -> dict[str, StepClock]:
    """Clocks around ``Scheduler.schedule`` and ``update_from_output`` as the engine calls
    them (elastickv's hooks, installed when the engine was built, included)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    clocks = {}
    for name in ("schedule", "update_from_output"):
        clock = clocks[name] = StepClock()
        setattr(Scheduler, name, clock.wrap(getattr(Scheduler, name)))
    return clocks


def summarise_profile(profiler: cProfile.Profile, top: int) -> dict[str, Any]:
    """One profiled run: steps, µs per step for each entry point, most own time."""
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    steps = max(cumulative(stats, "sched/scheduler.py", "schedule")[1], 1)
    entry = {}
    for label, suffix, name in ENTRY_POINTS:
        seconds, calls = cumulative(stats, suffix, name)
        entry[label] = {"us_per_step": seconds / steps * 1e6, "calls": calls}
    return {
        "steps": steps,
        "step_us": entry[ENTRY_POINTS[0][0]]["us_per_step"],
        "entry": entry,
        "top_own_time": top_own_time(stats, top),
    }


def child(args: argparse.Namespace) -> None:
    """One side: build the engine, warm up, time, profile; print one JSON line."""
    from vllm import LLM, SamplingParams

    from elastickv.models import ensure_tiny_model

    llm = LLM(
        model=str(ensure_tiny_model(args.model)),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        block_size=BLOCK_SIZE,
        max_num_seqs=args.concurrency,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    texts = prompts(args.requests)
    llm.generate(texts[: args.concurrency], params, use_tqdm=False)  # warm-up
    timed: list[dict[str, float]] = []
    profiled: list[dict[str, Any]] = []
    clocks = install_step_clocks()
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        for clock in clocks.values():
            clock.reset()
        outputs = llm.generate(texts, params, use_tqdm=False)
        timed.append(
            {
                "wall_s": time.perf_counter() - wall,
                "cpu_s": time.process_time() - cpu,
                **{f"{name}_us": clock.per_call_us() for name, clock in clocks.items()},
            }
        )
        for clock in clocks.values():
            clock.enabled = False  # the profiled run measures itself
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(texts, params, use_tqdm=False)
        profiler.disable()
        profiled.append(summarise_profile(profiler, args.top))
        for clock in clocks.values():
            clock.enabled = True
    fastest = min(profiled, key=lambda run: float(run["step_us"]))
    entry = {
        label: {
            # Each entry point's fastest repeat: the load only ever adds time.
            "us_per_step": min(run["entry"][label]["us_per_step"] for run in profiled),
            "calls": fastest["entry"][label]["calls"],
        }
        for label, *_ in ENTRY_POINTS
    }
    print(
        "RESULT "
        + json.dumps(
            {
                "steps": fastest["steps"],
                "timed": {key: min(run[key] for run in timed) for key in timed[0]},
                "entry_points": entry,
                "top_own_time": fastest["top_own_time"],
                "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
            }
        ),
        flush=True,
    )
    llm.llm_engine.engine_core.shutdown()


def run_side(side: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, __file__, "--child", *sys.argv[1:]]
    if side == "elastic":
        extra |= {"ELASTICKV": "1", "ELASTICKV_VIRTUAL_CAPACITY": str(args.kv_cache_bytes)}
        if args.budget is not None:
            extra |= {"ELASTICKV_BUDGET": str(args.budget)}
            extra |= {"ELASTICKV_PAGE_SIZE": str(SATURATE_PAGE_BYTES)}
        extra |= ledger_env(tmp / "ledger")
        extra |= args.elastic_settings
    elif args.budget is not None:
        command += ["--kv-cache-bytes", str(args.budget)]  # the last one given counts
    env = hermetic_env(tmp / f"vllm-cache-{side}", extra)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise SystemExit(f"the {side} engine failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def fastest_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's engines (one per round) as one: each number the fastest of them, the
    own-time table from the engine with the fastest profiled step."""
    best = min(runs, key=lambda run: float(run["entry_points"][ENTRY_POINTS[0][0]]["us_per_step"]))
    return {
        "steps": best["steps"],
        "timed": {key: min(run["timed"][key] for run in runs) for key in best["timed"]},
        "entry_points": {
            label: {
                "us_per_step": min(run["entry_points"][label]["us_per_step"] for run in runs),
                "calls": best["entry_points"][label]["calls"],
            }
            for label in best["entry_points"]
        },
        "top_own_time": best["top_own_time"],
        "token_ids": best["token_ids"],
    }


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    native, elastic = results["native"], results["elastic"]
    rows = []
    for label, *_ in ENTRY_POINTS:
        n = native["entry_points"][label]["us_per_step"]
        e = elastic["entry_points"][label]["us_per_step"]
        rows.append(
            {"entry_point": label, "native_us": n, "elastic_us": e, "ratio": e / n if n else None}
        )
    return {
        "vllm": vllm_version(),
        "workload": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "kv_cache_bytes": args.kv_cache_bytes,
            "budget": args.budget,
            "elastic_env": args.elastic_settings,
        },
        "steps": {side: results[side]["steps"] for side in results},
        "unprofiled": {side: results[side]["timed"] for side in results},
        "unprofiled_ratios": {
            key: elastic["timed"][key] / native["timed"][key] for key in native["timed"]
        },
        "per_step": rows,
        "top_own_time": {side: results[side]["top_own_time"] for side in results},
        "greedy_identical": native["token_ids"] == elastic["token_ids"],
    }


def print_report(data: dict[str, Any]) -> None:
    from rich.table import Table

    from elastickv.cli.tables import output_console, print_table

    console = output_console()
    work = data["workload"]
    table = Table(
        title=f"vLLM {data['vllm']} engine core under cProfile: {work['requests']} requests x "
        f"{work['max_tokens']} tokens, at most {work['concurrency']} running, "
        f"elastic settings {work['elastic_env'] or 'default'}"
        + ("" if work["budget"] is None else f", {work['budget']} bytes of KV on both sides")
        + " (µs per scheduler step)"
    )
    for column in ("entry point", "native", "elastic", "elastic/native"):
        table.add_column(column)
    for row in data["per_step"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        native, elastic = f"{row['native_us']:.1f}", f"{row['elastic_us']:.1f}"
        table.add_row(row["entry_point"], native, elastic, ratio)
    print_table(console, table)
    for side in ("native", "elastic"):
        timed = data["unprofiled"][side]
        console.print(
            f"{side}: {data['steps'][side]} steps; unprofiled: {timed['wall_s']:.3f} s wall, "
            f"{timed['cpu_s']:.3f} s CPU, schedule {timed['schedule_us']:.1f} µs, "
            f"update_from_output {timed['update_from_output_us']:.1f} µs per step"
        )
        own = Table(title=f"{side}: most own time in the scheduler's modules")
        for column in ("function", "calls", "own ms"):
            own.add_column(column)
        for row in data["top_own_time"][side]:
            own.add_row(row["function"], str(row["calls"]), f"{row['own_s'] * 1e3:.1f}")
        print_table(console, own)
    ratios = ", ".join(f"{key} {value:.3f}" for key, value in data["unprofiled_ratios"].items())
    console.print(f"unprofiled, elastic/native (fastest repeats): {ratios}")
    console.print(f"greedy outputs identical: {data['greedy_identical']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", default="tiny-llama", help="built-in tiny model name")
    parser.add_argument("--requests", type=int, default=64, help="requests (64)")
    parser.add_argument("--concurrency", type=int, default=32, help="most running at once (32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (64)")
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=KV_CACHE_BYTES, help="KV cache of both sides"
    )
    parser.add_argument(
        "--budget",
        type=int,
        help="physical KV bytes of both sides: native's KV cache, elastickv's limit",
    )
    add_elastic_env_option(parser)
    parser.add_argument("--top", type=int, default=15, help="functions listed by own time")
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs per engine; the fastest counts (5)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="engines per side, alternating sides (2)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in (
        "requests",
        "concurrency",
        "max_tokens",
        "kv_cache_bytes",
        "top",
        "repeats",
        "rounds",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    budget_ok = args.budget is None or 0 < args.budget < args.kv_cache_bytes
    if not (args.child or budget_ok):  # (native's child gets a KV cache of the budget)
        parser.error(f"--budget must be above 0 and below the KV cache ({args.kv_cache_bytes})")
    try:
        args.elastic_settings = elastic_settings(args.elastic_env)
    except ValueError as exc:
        parser.error(str(exc))
    if vllm_version() is None:
        parser.error("vLLM is not installed in this interpreter; run it with the vLLM venv")
    if args.child:
        child(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="profile-engine-") as name:
        tmp = Path(name)
        (tmp / "ledger").mkdir(mode=0o700)
        runs: dict[str, list[dict[str, Any]]] = {"native": [], "elastic": []}
        for index in range(args.rounds):
            # Alternate which side goes first: machine drift hits both alike.
            for side in ("native", "elastic") if index % 2 == 0 else ("elastic", "native"):
                runs[side].append(run_side(side, args, tmp))
    data = report({side: fastest_of(found) for side, found in runs.items()}, args)
    data["greedy_identical"] = all(
        run["token_ids"] == runs["native"][0]["token_ids"]
        for found in runs.values()
        for run in found
    )
    if args.json:
        print(json.dumps(data))
    else:
        print_report(data)
    return 0 if data["greedy_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
