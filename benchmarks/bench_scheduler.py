"""The scheduler alone, native vLLM vs elastickv: CPU per step with no model in the way.

``bench_vllm.py`` measures a whole server, where the engine core's CPU is mostly vLLM's
busy-wait for the worker and two processes share two cores; ``profile_engine.py`` runs the
model too. Both leave the scheduler's own cost inside noise larger than the difference we
look for. This benchmark runs vLLM 0.32's real ``Scheduler`` (its config built by vLLM's
``EngineArgs`` for the built-in tiny model, as an engine would) with a model runner's output
made up from the schedule: every request whose prompt is computed gets one token per step.
Nothing but ``schedule`` and ``update_from_output`` runs, so the measurement is their thread
CPU time, on two sides:

* native: vLLM's own ``BlockPool`` over a KV cache of ``--kv-cache-bytes`` (or the budget);
* elastic: elastickv's hooks and pool (installed as the plugin installs them) over a real
  host range, its capacity admitted by a real ledger record.

Each side runs in its own process (the hooks patch vLLM's classes), both kept warm at once:
the parent asks each for one pass of the workload in turn, alternating which goes first,
``--passes`` times, then starts a fresh pair (another hash seed and memory layout, which
alone move a CPython process by a few per cent) for each of ``--rounds``. Each pair of
adjacent passes gives one ratio, elastic / native CPU per pass (> 1: elastickv costs more);
the median and quartiles of those are reported, and the ratio of each side's fastest pass
(the machine's load only ever adds time). ``--calibrate`` runs native on both sides: the
ratio this machine gives for no difference at all.

With a limit (``--budget B``; by default 64 KiB per running request), native gets a KV cache
of B, elastickv a limit of B (64 KiB pages) under the full virtual cache, so admissions are
refused at the limit and vLLM preempts on both sides; the steps each side took are reported.

    .venvs/vllm-0.32/bin/python benchmarks/bench_scheduler.py [--concurrency 8 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastickv.bench.vllm_server import hermetic_env, ledger_env, vllm_version

BLOCK_SIZE = 32
KV_CACHE_BYTES = 64 << 20
LIMIT_PAGE_BYTES = 64 << 10  # as bench_vllm.py's saturation workload
# The default budget per running request: 512 KiB at 8 running (16 blocks of 32 KiB, where
# the prompts take 1–6 each), as bench_vllm.py's --budget runs.
BUDGET_PER_RUNNING = 64 << 10
MAX_MODEL_LEN = 256
VOCAB = 512  # the built-in tiny model's
PROMPT_TOKENS = (24, 160)  # each prompt's length is drawn from this range (seeded)


def prompt_token_ids(requests: int, vocab: int) -> list[list[int]]:
    """The same prompts on both sides: seeded lengths and tokens."""
    rng = random.Random(0)
    low, high = PROMPT_TOKENS
    return [
        [rng.randrange(1, vocab) for _ in range(rng.randrange(low, high + 1))]
        for _ in range(requests)
    ]


def build_scheduler(args: argparse.Namespace, elastic: bool) -> Any:
    """vLLM's scheduler as an engine core builds it, with one full-attention KV-cache group
    of the tiny model's layers; the elastic side gets its store and hooks first."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from elastickv.models import ensure_tiny_model

    engine_args = EngineArgs(
        model=str(ensure_tiny_model(args.model)),
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        max_num_seqs=args.concurrency,
        enable_prefix_caching=False,
        seed=0,
    )
    config = engine_args.create_engine_config()
    hf = config.model_config.hf_config
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    head_size = hf.hidden_size // hf.num_attention_heads
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=hf.num_key_value_heads,
        head_size=getattr(hf, "head_dim", None) or head_size,
        dtype=torch.float32,
    )
    block_bytes = spec.page_size_bytes * len(layers)
    kv_bytes = args.kv_cache_bytes if elastic or args.budget is None else args.budget
    num_blocks = kv_bytes // block_bytes
    config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],  # the scheduler never reads them
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    if elastic:
        publish_store(num_blocks, hf.num_hidden_layers, spec)
    scheduler_class = config.scheduler_config.get_scheduler_cls()
    return scheduler_class(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,  # as the OpenAI server runs it
    )


def publish_store(num_blocks: int, num_layers: int, spec: Any) -> None:
    """What the elastic plugin does before the scheduler is built: settings from the
    environment, the scheduler hooks, and a store whose pages a ledger record admits from
    credit under its limit (the page operations of each step go nowhere: no worker maps
    them here; what a worker's mapping costs is ``bench_grants.py``'s)."""
    from elastickv.geometry import KVCacheGeometry
    from elastickv.integrations.vllm.config import ElasticConfig
    from elastickv.integrations.vllm.scheduler import scheduler_hooks
    from elastickv.integrations.vllm.scheduler.store import REGISTRY, ElasticStore, default_policy

    config = ElasticConfig.from_env()
    scheduler_hooks.install()
    geometry = KVCacheGeometry(
        num_layers=num_layers,
        num_blocks=num_blocks,
        num_kv_heads=spec.num_kv_heads,
        block_size=spec.block_size,
        head_size=spec.head_size,
        dtype="float32",
    )
    REGISTRY.publish(
        ElasticStore.for_workers(
            config, geometry, geometry.backing_bytes, 1, "host", default_policy
        )
    )


def run_pass(scheduler: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt through the scheduler until all finish; thread CPU of its two methods."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    base = f"{time.monotonic_ns()}-"
    for index, tokens in enumerate(prompts):
        scheduler.add_request(Request(base + str(index), tokens, params, None))
    clock = time.thread_time_ns
    schedule_ns = update_ns = steps = preempted = 0
    requests = scheduler.requests
    while scheduler.has_unfinished_requests():
        start = clock()
        output = scheduler.schedule()
        middle = clock()
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for request_id in ids:  # a token for every request whose prompt is now computed
            request = requests[request_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([(request.num_tokens * 7) % (VOCAB - 1) + 1] if done else [])
        runner_output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        middle2 = clock()
        scheduler.update_from_output(output, runner_output)
        end = clock()
        schedule_ns += middle - start
        update_ns += end - middle2
        steps += 1
        preempted += len(getattr(output, "preempted_req_ids", None) or ())
    return {
        "cpu_s": (schedule_ns + update_ns) / 1e9,
        "schedule_s": schedule_ns / 1e9,
        "update_s": update_ns / 1e9,
        "steps": steps,
        "preempted": preempted,
    }


def child(args: argparse.Namespace, elastic: bool) -> None:
    """One side, driven by the parent over stdin/stdout: build and warm up, say ``READY``,
    then one pass per ``run`` line (one ``RESULT`` line each) until stdin closes."""
    scheduler = build_scheduler(args, elastic)
    prompts = prompt_token_ids(args.requests, VOCAB)
    run_pass(scheduler, prompts, args)  # warm-up
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        found = run_pass(scheduler, prompts, args)
        if elastic:
            found["elastic_stats"] = scheduler.kv_cache_manager.block_pool.elastic_stats()
        print("RESULT " + json.dumps(found), flush=True)
    scheduler.shutdown()


class Side:
    """One side's process, kept warm between passes."""

    def __init__(self, side: str, args: argparse.Namespace, tmp: Path) -> None:
        extra: dict[str, str] = {}
        if side == "elastic":
            extra = {"ELASTICKV": "1", "ELASTICKV_VIRTUAL_CAPACITY": str(args.kv_cache_bytes)}
            if args.budget is not None:
                extra |= {
                    "ELASTICKV_BUDGET": str(args.budget),
                    "ELASTICKV_PAGE_SIZE": str(LIMIT_PAGE_BYTES),
                }
            extra |= ledger_env(tmp / "ledger")
        self.side = side
        # vLLM's log, shown if the side fails; it lives as long as the process (see close).
        self.errors = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--child", side, *args.child_argv],
            env=hermetic_env(tmp / f"vllm-cache-{side}", extra),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
        )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        self.errors.seek(0)
        log = self.errors.read()[-4000:]
        raise SystemExit(f"the {self.side} scheduler failed (exit {self.process.wait()}):\n{log}")

    def run(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        found: dict[str, Any] = json.loads(self._expect("RESULT "))
        return found

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.errors.close()


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One workload: ``--rounds`` pairs of processes (fresh ones each round: another hash
    seed and memory layout), both sides warm at once, ``--passes`` passes each per round,
    alternating which goes first; each pair of adjacent passes gives one ratio. With
    ``--calibrate`` the elastic side is a second native process (an A/A run)."""
    second = "native" if args.calibrate else "elastic"
    runs: dict[str, list[dict[str, Any]]] = {"native": [], "elastic": []}
    for _ in range(args.rounds):
        sides = {"native": Side("native", args, tmp), "elastic": Side(second, args, tmp)}
        try:
            for index in range(args.passes):
                for name in ("native", "elastic") if index % 2 == 0 else ("elastic", "native"):
                    runs[name].append(sides[name].run())
        finally:
            for side in sides.values():
                side.close()
    per_pass = sorted(
        e["cpu_s"] / n["cpu_s"] for n, e in zip(runs["native"], runs["elastic"], strict=True)
    )
    q1, median, q3 = statistics.quantiles(per_pass, n=4) if len(per_pass) > 1 else per_pass * 3

    def best(side: str, key: str) -> float:
        return min(float(run[key]) for run in runs[side])

    steps = {side: runs[side][-1]["steps"] for side in runs}
    return {
        "concurrency": args.concurrency,
        "budget": args.budget,
        "passes": args.passes,
        "steps": steps,
        "preempted": {side: runs[side][-1]["preempted"] for side in runs},
        "native_us_per_step": best("native", "cpu_s") / steps["native"] * 1e6,
        "elastic_us_per_step": best("elastic", "cpu_s") / steps["elastic"] * 1e6,
        "ratio": median,
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_best": best("elastic", "cpu_s") / best("native", "cpu_s"),
        "ratio_schedule": best("elastic", "schedule_s") / best("native", "schedule_s"),
        "ratio_update": best("elastic", "update_s") / best("native", "update_s"),
        "calibration": args.calibrate,
        "elastic_stats": runs["elastic"][-1].get("elastic_stats"),
    }


def print_row(row: dict[str, Any]) -> None:
    budget = "no limit" if row["budget"] is None else f"limit {row['budget'] // 1024} KiB"
    second = "elastic"
    if row["calibration"]:
        budget += " (A/A: native on both sides)"
        second = "native again"
    steps = row["steps"]
    print(
        f"{row['concurrency']} running, {budget}: {steps['native']} / {steps['elastic']} steps; "
        f"µs per step {row['native_us_per_step']:.1f} native, "
        f"{row['elastic_us_per_step']:.1f} {second}; ratio {row['ratio']:.3f} "
        f"[{row['ratio_q1']:.3f}, {row['ratio_q3']:.3f}], fastest passes "
        f"{row['ratio_best']:.3f} (schedule {row['ratio_schedule']:.3f}, "
        f"update_from_output {row['ratio_update']:.3f})",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", default="tiny-llama", help="built-in tiny model name")
    parser.add_argument("--requests", type=int, default=128, help="requests per pass (128)")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[8, 32], help="most running at once"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (64)")
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=KV_CACHE_BYTES, help="KV cache of both sides"
    )
    parser.add_argument(
        "--budget",
        type=int,
        nargs="*",
        help="physical KV bytes (native's KV cache, elastickv's limit), one run each "
        f"besides the one without (default: {BUDGET_PER_RUNNING // 1024} KiB per running "
        "request, tight enough that admissions are refused; none given: no such run)",
    )
    parser.add_argument("--passes", type=int, default=20, help="passes per side and round (20)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="fresh process pairs per workload (2)"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="A/A run: native on both sides, the ratio the machine alone gives",
    )
    parser.add_argument("--child", choices=("native", "elastic"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.concurrency = args.concurrency[0]
        args.budget = args.budget[0] if args.budget else None
        child(args, args.child == "elastic")
        return 0
    for name in ("requests", "max_tokens", "kv_cache_bytes", "passes", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(c < 1 for c in args.concurrency):
        parser.error("--concurrency must be at least 1")
    if any(not 0 < b < args.kv_cache_bytes for b in args.budget or ()):
        parser.error(f"--budget must be above 0 and below the KV cache ({args.kv_cache_bytes})")
    if vllm_version() is None:
        parser.error("vLLM is not installed in this interpreter; run it with the vLLM venv")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-scheduler-") as name:
        tmp = Path(name)
        (tmp / "ledger").mkdir(mode=0o700)
        for concurrency in args.concurrency:
            budgets = [BUDGET_PER_RUNNING * concurrency] if args.budget is None else args.budget
            for budget in [None, *budgets]:
                run_args = argparse.Namespace(**vars(args))
                run_args.concurrency = concurrency
                run_args.budget = budget
                run_args.child_argv = [
                    "--model", args.model,
                    "--requests", str(args.requests),
                    "--concurrency", str(concurrency),
                    "--max-tokens", str(args.max_tokens),
                    "--kv-cache-bytes", str(args.kv_cache_bytes),
                    *(["--budget", str(budget)] if budget is not None else []),
                ]  # fmt: skip
                results.append(measure(run_args, tmp))
                if not args.json:
                    print_row(results[-1])
    if args.json:
        print(json.dumps({"vllm": vllm_version(), "requests": args.requests, "results": results}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
