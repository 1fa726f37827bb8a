"""vLLM OpenAI server, native vs elastickv (``ELASTICKV=1``), on the same workload in one run.

Each round starts a native and an elastic server one after the other (the order alternates
between rounds; each gets a fresh vLLM cache root) and measures start-up (spawn to ``/health``
200). With both up, it sends each an untimed warm-up wave, then alternates timed passes between
them in ABBA order (``--passes`` each; a pass is ``--requests`` streaming greedy completions at
``--concurrency``), so machine drift hits both sides alike. Both are stopped with SIGTERM and
their whole process trees awaited. Reported per side (medians) and as ratios elastic / native
(medians of per-pair ratios): output tokens/s, mean and p99 time to first token, start-up;
and the CPU seconds per timed pass of each server process and of the scheduler alone: the
engine core thread's CPU inside ``Scheduler.schedule`` and ``update_from_output``, counted on
both sides by the plugin's scheduler clock (``ELASTICKV_SCHEDULER_CLOCK``), since the engine
core process spins while its worker computes. Greedy outputs must be identical across every
server of both sides.

``--budget B`` gives both sides B bytes of physical KV: native vLLM a KV cache of B, elastickv a
limit of B (``ELASTICKV_BUDGET``, 64 KiB pages) under the full virtual cache, so both sides
run short of blocks (native preempts, elastickv refuses and preempts) on the same memory.

``--cold-burst`` runs the cold-burst workload: 64 requests at once against engines that run 16
at a time, the elastic side releasing every page it frees (``ELASTICKV_HOT_MAX_PAGES=0``,
64 KiB pages), so each pass starts cold: every page it takes is granted in the step that
needs it and mapped by the worker before that step runs.

``--saturate`` runs the saturation workload: 64 requests at concurrency 32 against a KV cache
(``--kv-cache-memory-bytes``, the same on both sides) that holds about half of what they need
at once, so native vLLM itself preempts; each side's preemptions (vLLM's
``vllm:num_preemptions`` counter) are reported with the ratios. Its elastic side uses 64 KiB
pages (the default 2 MiB page is larger than that whole cache).

    .venvs/vllm-0.32/bin/python benchmarks/bench_vllm.py [--json] [--quick]
        [--saturate | --cold-burst]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elastickv.bench.monitor import counter, machine_report
from elastickv.bench.vllm_server import (
    HOST,
    Server,
    add_elastic_env_option,
    cpu_seconds,
    elastic_settings,
    hermetic_env,
    ledger_env,
    scrape_metrics,
    server,
    stop,
    vllm_version,
)
from elastickv.integrations.vllm.config import SCHEDULER_CLOCK_VAR
from elastickv.integrations.vllm.scheduler.scheduler_clock import (
    SchedulerTimes,
    create_clock_file,
    read_clock,
)

THROUGHPUT_TARGET = 0.98
TTFT_TARGET = 1.05
REQUEST_TIMEOUT_S = 120.0
KV_CACHE_BYTES = 64 << 20
# The saturation workload's KV cache: 48 blocks of 32 tokens (the fp32 tiny model holds 1 KiB
# a token), half of the 96 that 32 requests of 15-30 prompt and 64 output tokens reach at once.
SATURATE_KV_CACHE_BYTES = 3 << 19
# Pages that tile that cache (the default 2 MiB page is larger than all of it): two blocks each.
SATURATE_PAGE_BYTES = 64 << 10
DEFAULT_LOAD = {"requests": 32, "concurrency": 8}
SATURATE = {"requests": 64, "concurrency": 32}
# The cold-burst workload: every request at once on an idle engine, more than it runs at a
# time (the rest wait in its queue), and the elastic side keeps no page once it is free
# (each pass starts with nothing committed) on pages of 64 KiB (two blocks: many commits).
COLD_BURST = {"requests": 64, "concurrency": 64}
COLD_BURST_MAX_NUM_SEQS = 16
COLD_BURST_ENV = {"ELASTICKV_HOT_MAX_PAGES": "0", "ELASTICKV_PAGE_SIZE": str(64 << 10)}
SERVER_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--enforce-eager",
    "--block-size",
    "32",
    "--no-enable-prefix-caching",
    "--seed",
    "0",
]
WORDS = ["alpha", "beta", "gamma", "delta", "sky", "river", "stone", "light", "cloud", "iron"]


@dataclass(frozen=True)
class Workload:
    """What every server of both sides is asked, identically."""

    requests: int
    concurrency: int
    max_tokens: int
    passes: int


@dataclass(frozen=True)
class Started:
    """One server's life: start-up and shutdown (one side, one round)."""

    side: str
    round: int
    startup_s: float
    stop_s: float
    left_processes: int
    kv_cache_tokens: int | None
    cpu_s_per_pass: dict[str, float]
    preemptions: int | None  # vLLM's counter over the server's life (warm-up included)
    scheduler_steps_per_pass: float  # ``Scheduler.schedule`` calls (the scheduler clock)


@dataclass(frozen=True)
class Pass:
    """One timed pass of the workload against one server."""

    side: str
    round: int
    index: int
    tokens_per_s: float
    ttft_mean_ms: float
    ttft_p99_ms: float
    output_tokens: int


def prompts(n: int) -> list[str]:
    """``n`` fixed prompts of varied length."""
    return [
        f"Request {i}: " + " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(4 + i % 9))
        for i in range(n)
    ]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def thread_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: this process's CPUs split into
    that many contiguous groups (``"0|1"`` for 2 ranks on 2 cores). vLLM's CPU workers refuse
    to start several ranks on one NUMA node without it."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise SystemExit(f"--tensor-parallel-size {ranks} needs {ranks} CPUs; {len(cpus)} here")
    size = len(cpus) // ranks
    groups = [cpus[r * size : (r + 1) * size] for r in range(ranks)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


def stream_completion(
    port: int, model: str, prompt: str, max_tokens: int
) -> tuple[float, int, str, float]:
    """One streaming greedy completion: TTFT s, output tokens, text, end time (monotonic)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_S)
    try:
        start = time.monotonic()
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        ttft: float | None = None
        pieces: list[str] = []
        chunks = 0
        usage: int | None = None
        while line := response.readline():
            text = line.decode().strip()
            if not text.startswith("data:"):
                continue
            data = text[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or []:
                if ttft is None:
                    ttft = time.monotonic() - start
                chunks += 1
                pieces.append(choice.get("text") or "")
            if event.get("usage"):
                usage = int(event["usage"]["completion_tokens"])
        end = time.monotonic()
    finally:
        conn.close()
    if ttft is None:
        raise RuntimeError("stream ended without a token")
    return ttft, usage if usage is not None else chunks, "".join(pieces), end


def run_wave(
    srv: Server, work: Workload, texts: list[str]
) -> tuple[float, list[float], int, list[str]]:
    """Send every prompt at ``work.concurrency``; wall seconds, TTFTs, tokens, outputs."""
    with ThreadPoolExecutor(work.concurrency) as pool:
        start = time.monotonic()
        results = list(
            pool.map(lambda p: stream_completion(srv.port, srv.model, p, work.max_tokens), texts)
        )
    wall = max(r[3] for r in results) - start
    return wall, [r[0] for r in results], sum(r[1] for r in results), [r[2] for r in results]


KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def kv_cache_tokens(log: Path) -> int | None:
    match = KV_TOKENS.search(log.read_text(errors="replace"))
    return None if match is None else int(match.group(1).replace(",", ""))


def preemptions(srv: Server) -> int | None:
    """vLLM's preemption counter, from the server's ``/metrics`` (None if absent)."""
    count = counter(scrape_metrics(srv), "vllm:num_preemptions_total")
    return None if count is None else int(count)


def measure(
    srv: Server, side: str, index: int, number: int, work: Workload
) -> tuple[Pass, list[float], list[str]]:
    """One timed pass; also its TTFTs (s) and greedy outputs."""
    seconds, ttfts, tokens, outputs = run_wave(srv, work, prompts(work.requests))
    result = Pass(
        side=side,
        round=index,
        index=number,
        tokens_per_s=round(tokens / seconds, 1),
        ttft_mean_ms=round(statistics.fmean(ttfts) * 1e3, 2),
        ttft_p99_ms=round(percentile(ttfts, 99) * 1e3, 2),
        output_tokens=tokens,
    )
    return result, ttfts, outputs


def run_round(
    index: int,
    model: str,
    work: Workload,
    envs: dict[str, dict[str, str]],
    tmp: Path,
    server_args: dict[str, list[str]],
) -> tuple[list[Started], list[Pass], dict[str, list[float]], list[list[str]]]:
    """Start both servers one after the other, then alternate timed passes between them."""
    order = ["native", "elastic"] if index % 2 == 0 else ["elastic", "native"]
    started: list[Started] = []
    passes: list[Pass] = []
    ttfts: dict[str, list[float]] = {"native": [], "elastic": []}
    outputs: list[list[str]] = []
    with contextlib.ExitStack() as stack:
        servers: dict[str, tuple[Server, float]] = {}
        clocks = {side: tmp / f"{side}-{index}.clock" for side in order}
        for side in order:
            create_clock_file(clocks[side])
            env = {**envs[side], SCHEDULER_CLOCK_VAR: str(clocks[side])}
            servers[side] = stack.enter_context(
                server(model, env, tmp / f"{side}-{index}.log", server_args[side])
            )
        for side in order:  # warm-up, untimed
            run_wave(servers[side][0], work, prompts(work.requests)[: work.concurrency])
        cpu_before = {side: cpu_seconds(servers[side][0]) for side in order}
        clock_before = {side: read_clock(clocks[side]) for side in order}
        for number in range(work.passes):
            # ABBA order: neither side always runs right after the other's pass.
            for side in order if number % 2 == 0 else order[::-1]:
                result, firsts, texts = measure(servers[side][0], side, index, number, work)
                passes.append(result)
                ttfts[side] += firsts
                outputs.append(texts)
        preempted = {side: preemptions(servers[side][0]) for side in order}
        cpu: dict[str, dict[str, float]] = {}
        steps: dict[str, float] = {}
        for side in order:
            after = cpu_seconds(servers[side][0])
            cpu[side] = {
                name: round((used - cpu_before[side].get(name, 0.0)) / work.passes, 3)
                for name, used in after.items()
            }
            clocked: SchedulerTimes = read_clock(clocks[side]) - clock_before[side]
            cpu[side][SCHEDULER_CPU] = round(clocked.cpu_s / work.passes, 4)
            steps[side] = round(clocked.schedule_calls / work.passes, 1)
        for side in order:
            srv, startup = servers[side]
            stop_s, left = stop(srv)
            started.append(
                Started(
                    side=side,
                    round=index,
                    startup_s=round(startup, 2),
                    stop_s=round(stop_s, 2),
                    left_processes=left,
                    kv_cache_tokens=kv_cache_tokens(srv.log),
                    cpu_s_per_pass=cpu[side],
                    preemptions=preempted[side],
                    scheduler_steps_per_pass=steps[side],
                )
            )
    return started, passes, ttfts, outputs


# The engine core thread's CPU inside ``Scheduler.schedule`` and ``update_from_output`` (the
# plugin's scheduler clock, on both sides), beside the processes' CPU: on the CPU backend the
# engine core process spins while its worker runs, so its CPU follows the wall time.
SCHEDULER_CPU = "scheduler (in EngineCore)"


def paired_ratio(items: list[Any], key: str, pair: tuple[str, ...]) -> float:
    """Median over pairs (same ``pair`` attributes) of elastic/native for ``key``."""
    groups: dict[tuple[Any, ...], dict[str, float]] = {}
    for item in items:
        groups.setdefault(tuple(getattr(item, a) for a in pair), {})[item.side] = float(
            getattr(item, key)
        )
    return round(statistics.median(g["elastic"] / g["native"] for g in groups.values()), 3)


def cpu_ratios(started: list[Started]) -> dict[str, float]:
    """Per process title on both sides: the median over rounds of elastic/native CPU seconds
    per timed pass (the CPU is read once per server, over all of its passes)."""
    per_round: dict[str, list[float]] = {}
    for index in sorted({s.round for s in started}):
        pair = {s.side: s.cpu_s_per_pass for s in started if s.round == index}
        for name, used in pair.get("native", {}).items():
            mine = pair.get("elastic", {}).get(name)
            if mine is not None and used > 0:
                per_round.setdefault(name, []).append(mine / used)
    return {name: round(statistics.median(values), 3) for name, values in per_round.items()}


def summarise(
    started: list[Started],
    passes: list[Pass],
    ttfts: dict[str, list[float]],
    outputs: list[list[str]],
    work: Workload,
) -> dict[str, Any]:
    sides: dict[str, Any] = {}
    for side in ("native", "elastic"):
        mine = [p for p in passes if p.side == side]
        lives = [s for s in started if s.side == side]
        sides[side] = {
            "tokens_per_s": round(statistics.median(p.tokens_per_s for p in mine), 1),
            "ttft_mean_ms": round(statistics.median(p.ttft_mean_ms for p in mine), 2),
            "ttft_p99_ms": round(statistics.median(p.ttft_p99_ms for p in mine), 2),
            "ttft_p99_all_passes_ms": round(percentile(ttfts[side], 99) * 1e3, 2),
            "startup_s": round(statistics.median(s.startup_s for s in lives), 2),
            "stop_s": round(statistics.median(s.stop_s for s in lives), 2),
            "kv_cache_tokens": lives[0].kv_cache_tokens,
            "preemptions": [s.preemptions for s in lives],
            "scheduler_steps_per_pass": [s.scheduler_steps_per_pass for s in lives],
            "cpu_s_per_pass": {
                name: round(statistics.median(s.cpu_s_per_pass.get(name, 0.0) for s in lives), 3)
                for name in lives[0].cpu_s_per_pass
            },
        }
    ratios = {
        "throughput": paired_ratio(passes, "tokens_per_s", ("round", "index")),
        "ttft_mean": paired_ratio(passes, "ttft_mean_ms", ("round", "index")),
        "ttft_p99": paired_ratio(passes, "ttft_p99_ms", ("round", "index")),
        "startup": paired_ratio(started, "startup_s", ("round",)),
    }
    expected = work.requests * work.max_tokens
    return {
        "median": sides,
        "ratios": ratios,
        "cpu_ratios": cpu_ratios(started),
        "meets_target": {
            "throughput": ratios["throughput"] >= THROUGHPUT_TARGET,
            "ttft_mean": ratios["ttft_mean"] <= TTFT_TARGET,
            "ttft_p99": ratios["ttft_p99"] <= TTFT_TARGET,
        },
        "greedy_identical": all(texts == outputs[0] for texts in outputs),
        "all_tokens_received": all(p.output_tokens == expected for p in passes),
        "clean_shutdown": all(s.left_processes == 0 for s in started),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 passes (~2-3 min)")
    parser.add_argument("--model", default="tiny-llama", help="built-in tiny model name")
    parser.add_argument("--requests", type=int, default=None, help="requests per pass (32)")
    parser.add_argument("--concurrency", type=int, default=None, help="in flight at once (8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (64)")
    parser.add_argument("--passes", type=int, default=None, help="timed passes per server (6)")
    parser.add_argument("--rounds", type=int, default=None, help="native+elastic server pairs (2)")
    add_elastic_env_option(parser)
    parser.add_argument(
        "--saturate",
        action="store_true",
        help="the saturation workload: more in flight than the KV cache holds "
        f"({SATURATE['requests']} requests at {SATURATE['concurrency']}, "
        f"{SATURATE_KV_CACHE_BYTES / 2**20:g} MiB KV cache)",
    )
    parser.add_argument(
        "--cold-burst",
        action="store_true",
        help=f"the cold-burst workload: {COLD_BURST['requests']} requests at once, "
        f"{COLD_BURST_MAX_NUM_SEQS} running at a time, the elastic side starting every pass "
        "with no page committed",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="physical KV bytes of both sides: native vLLM's KV cache, elastickv's limit "
        "(ELASTICKV_BUDGET, 64 KiB pages) under the full virtual cache",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help=f"KV cache of both sides ({KV_CACHE_BYTES >> 20} MiB; --saturate: "
        f"{SATURATE_KV_CACHE_BYTES / 2**20:g} MiB)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the server logs")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks per engine, both sides (CPU threads bound with VLLM_CPU_OMP_THREADS_BIND)",
    )
    args = parser.parse_args()

    if vllm_version() is None:
        parser.error("vLLM is not installed in this interpreter; run it with the vLLM venv")
    kv_bytes = args.kv_cache_bytes or (SATURATE_KV_CACHE_BYTES if args.saturate else KV_CACHE_BYTES)
    if kv_bytes <= 0:
        parser.error(f"--kv-cache-bytes must be positive, got {kv_bytes}")
    elastic_env = {"ELASTICKV": "1", "ELASTICKV_VIRTUAL_CAPACITY": str(kv_bytes)}
    if args.saturate and args.cold_burst:
        parser.error("--saturate and --cold-burst are two workloads; choose one")
    if args.saturate:
        elastic_env["ELASTICKV_PAGE_SIZE"] = str(SATURATE_PAGE_BYTES)
    if args.cold_burst:
        elastic_env.update(COLD_BURST_ENV)
    if args.budget is not None:
        if not 0 < args.budget < kv_bytes:
            parser.error(f"--budget must be above 0 and below the KV cache ({kv_bytes} bytes)")
        elastic_env["ELASTICKV_BUDGET"] = str(args.budget)
        elastic_env.setdefault("ELASTICKV_PAGE_SIZE", str(SATURATE_PAGE_BYTES))
    try:
        elastic_env.update(elastic_settings(args.elastic_env))
    except ValueError as exc:
        parser.error(str(exc))
    quick = args.quick
    preset = SATURATE if args.saturate else COLD_BURST if args.cold_burst else DEFAULT_LOAD
    work = Workload(
        requests=args.requests or preset["requests"],
        concurrency=args.concurrency or preset["concurrency"],
        max_tokens=args.max_tokens or 64,
        passes=args.passes or (3 if quick else 6),
    )
    rounds = args.rounds or (1 if quick else 2)
    if args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size must be at least 1")
    base_args = list(SERVER_ARGS)
    if args.cold_burst:
        base_args += ["--max-num-seqs", str(COLD_BURST_MAX_NUM_SEQS)]
    common: dict[str, str] = {}
    if args.tensor_parallel_size > 1:
        base_args += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
        common["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", thread_binding(args.tensor_parallel_size)
        )
    # With --budget, native vLLM gets that much KV cache and elastickv a limit of that much
    # under the full virtual cache: the same physical memory on both sides.
    native_kv_bytes = kv_bytes if args.budget is None else args.budget
    server_args = {
        "native": [*base_args, "--kv-cache-memory-bytes", str(native_kv_bytes)],
        "elastic": [*base_args, "--kv-cache-memory-bytes", str(kv_bytes)],
    }

    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    load_before = os.getloadavg()
    begin = time.monotonic()
    started: list[Started] = []
    passes: list[Pass] = []
    ttfts: dict[str, list[float]] = {"native": [], "elastic": []}
    outputs: list[list[str]] = []
    try:
        (tmp / "ledger").mkdir(mode=0o700)
        extra = {
            "native": common,
            "elastic": {**common, **elastic_env, **ledger_env(tmp / "ledger")},
        }
        for index in range(rounds):
            # A fresh (cold) vLLM cache root per server: every start-up pays the same.
            envs = {
                side: hermetic_env(tmp / f"vllm-cache-{side}-{index}", extra[side])
                for side in ("native", "elastic")
            }
            lives, done, firsts, texts = run_round(index, model, work, envs, tmp, server_args)
            started += lives
            passes += done
            for side, values in firsts.items():
                ttfts[side] += values
            outputs += texts
            if not args.json:
                for item in [*lives, *done]:
                    print(item, file=sys.stderr)
    finally:
        if args.keep_logs:
            print(f"server logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    report: dict[str, Any] = {
        "vllm": vllm_version(),
        "model": args.model,
        "workload": {
            **asdict(work),
            "rounds": rounds,
            "temperature": 0,
            "ignore_eos": True,
            "saturate": args.saturate,
            "cold_burst": args.cold_burst,
            "kv_cache_bytes": kv_bytes,
            "budget": args.budget,
        },
        "server_args": server_args,
        "elastic_env": elastic_env,
        **summarise(started, passes, ttfts, outputs, work),
        "targets": {"throughput_min": THROUGHPUT_TARGET, "ttft_max": TTFT_TARGET},
        "servers": [asdict(s) for s in started],
        "passes": [asdict(p) for p in passes],
        "machine": machine_report(load_before),
        "wall_s": round(time.monotonic() - begin, 1),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_tables(report)
    return 0


def print_tables(report: dict[str, Any]) -> None:
    from rich.table import Table

    from elastickv.cli.tables import output_console, print_table

    console = output_console()
    work = report["workload"]
    title = (
        f"vLLM {report['vllm']} OpenAI server, {report['model']}: {work['requests']} requests x "
        f"{work['max_tokens']} tokens at concurrency {work['concurrency']}, "
        f"{work['passes']} passes x {work['rounds']} rounds (medians)"
    )
    table = Table(title=title)
    for column in ("metric", "native", "elastic", "elastic/native", "target"):
        table.add_column(column)
    median, ratios, ok = report["median"], report["ratios"], report["meets_target"]
    rows = [
        ("output tokens/s", "tokens_per_s", "throughput", "≥ 0.98"),
        ("TTFT mean, ms", "ttft_mean_ms", "ttft_mean", "≤ 1.05"),
        ("TTFT p99, ms", "ttft_p99_ms", "ttft_p99", "≤ 1.05"),
        ("start-up, s", "startup_s", "startup", "-"),
    ]
    for label, key, ratio, target in rows:
        mark = "" if ratio not in ok else (" ✓" if ok[ratio] else " ✗")
        table.add_row(
            label,
            f"{median['native'][key]:.1f}",
            f"{median['elastic'][key]:.1f}",
            f"{ratios[ratio]:.3f}{mark}",
            target,
        )
    print_table(console, table)
    for side in ("native", "elastic"):
        cpu = ", ".join(f"{k} {v:.3f}" for k, v in median[side]["cpu_s_per_pass"].items())
        console.print(f"{side} CPU seconds per timed pass: {cpu}")
    cpu = ", ".join(f"{k} {v:.3f}" for k, v in report["cpu_ratios"].items())
    console.print(f"CPU per pass, elastic/native (median over rounds): {cpu}")
    budget = work["budget"]
    memory = (
        f"KV cache {work['kv_cache_bytes'] / 2**20:g} MiB"
        if budget is None
        else f"{budget / 2**20:g} MiB of KV on both sides (native's cache, elastickv's limit "
        f"under {work['kv_cache_bytes'] / 2**20:g} MiB virtual)"
    )
    console.print(
        f"{memory} (native {median['native']['kv_cache_tokens']} tokens); preemptions per server: "
        f"native {median['native']['preemptions']}, elastic {median['elastic']['preemptions']}"
    )
    console.print(
        "scheduler steps per pass, per server: "
        f"native {median['native']['scheduler_steps_per_pass']}, "
        f"elastic {median['elastic']['scheduler_steps_per_pass']}"
    )
    console.print(
        f"greedy outputs identical: {report['greedy_identical']}; "
        f"all tokens received: {report['all_tokens_received']}; "
        f"clean shutdown: {report['clean_shutdown']}; "
        f"load average {report['machine']['loadavg_before']} -> "
        f"{report['machine']['loadavg_after']} on {report['machine']['cpus']} CPUs"
    )


if __name__ == "__main__":
    raise SystemExit(main())
