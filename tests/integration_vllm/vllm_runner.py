"""Run one clean vLLM engine (native or elastickv, chosen by the environment) and print JSON.

Usage: ``python vllm_runner.py MODEL_DIR SCENARIO [--block-size N] [--max-tokens N]``.
SCENARIO is ``functional``, ``concurrent``, ``all`` (both, one engine) or ``long`` (the
concurrent run with prompts of several full blocks). The engine is
stepped by hand so native and elastic runs schedule identically and the elastic run can
sample its kernel-reported footprint between steps. In-process the probe reads the block
pool's counters; in multiprocess mode it opens the worker's memfd (found through the
plugin's export RPC) and reads only the footprint. The JSON document is the last line of
stdout; the engine is shut down and its child processes are checked to be gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

FUNCTIONAL = [
    "Hello, my name is",
    "1 + 1 =",
    "The capital of France is",
    "机器学习是",
]
EXPORT_METHOD = "elastickv_export_kv_pool"


def concurrent_prompts(n: int) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "sky", "river", "stone", "light"]
    return [
        f"Request {i}: " + " ".join(words[(i + k) % 8] for k in range(3 + i % 5)) for i in range(n)
    ]


def long_prompts(n: int) -> list[str]:
    """``n`` distinct prompts of several full blocks each: under a tight budget a preempted
    request comes back as a prefix-cache hit on its own parked blocks."""
    words = ["alpha", "beta", "gamma", "delta", "sky", "river", "stone", "light"]
    return [
        f"Request {i}: " + " ".join(words[(i * 3 + k * 5) % 8] for k in range(40)) for i in range(n)
    ]


def _in_process_core(llm: Any) -> Any | None:
    return getattr(llm.llm_engine.engine_core, "engine_core", None)


def _probe(llm: Any, elastic: bool) -> tuple[Callable[[], dict[str, Any]] | None, list[int]]:
    """A stats sampler (None when native) and the fds it holds (to close before shutdown).

    Every worker rank's memfd is found through the plugin's export RPC and opened here (the
    test reads each rank's footprint from the kernel; no engine process opens another's), so
    each rank's footprint is read on its own; in-process the block pool's counters and the
    pages the scheduler granted come with it."""
    if not elastic:
        return None, []
    exports = llm.collective_rpc(EXPORT_METHOD)
    fds = [os.open(f"/proc/{e['pid']}/fd/{e['fd']}", os.O_RDONLY | os.O_CLOEXEC) for e in exports]

    def ranks() -> list[int]:
        return [os.fstat(fd).st_blocks * 512 for fd in fds]

    core = _in_process_core(llm)
    if core is None:

        def footprint() -> dict[str, Any]:
            per_rank = ranks()
            return {"footprint_bytes": sum(per_rank), "rank_footprint_bytes": per_rank}

        return footprint, fds
    pool = core.scheduler.kv_cache_manager.block_pool

    def stats() -> dict[str, Any]:
        out: dict[str, Any] = dict(pool.elastic_stats())
        per_rank = ranks()
        out["footprint_bytes"] = sum(per_rank)
        out["rank_footprint_bytes"] = per_rank
        # What each rank holds once it applied every batch of page operations sent so far.
        out["rank_granted_bytes"] = [out["granted_pages"] * out["page_size"]] * len(per_rank)
        out["admitted_bytes"] = pool.allocator.policy.admitted_bytes
        return out

    return stats, fds


def _ray_placement(llm: Any) -> dict[str, Any]:
    """Where vLLM's Ray executor put each worker rank, as vLLM sees it (each rank's node id
    and local rank, the broadcast queue's local and remote readers) and as the machine sees
    it (each rank's pid, from the plugin's export, and its parent: the raylet of its node).
    In-process engine core only (the executor lives in this process)."""
    import ray

    executor = llm.llm_engine.engine_core.engine_core.model_executor
    exports = llm.collective_rpc(EXPORT_METHOD)
    handles = sorted(executor.ray_worker_handles, key=lambda h: h.rank)
    ranks = []
    for handle, export in zip(handles, exports, strict=True):
        worker = psutil.Process(export["pid"])
        ranks.append(
            {
                "rank": handle.rank,
                "node_id": handle.node_id,
                "local_rank": handle.local_rank,
                "pid": worker.pid,
                "parent_pid": worker.ppid(),
                # The audit log the worker's interpreter started with (its node's setting).
                "audit_log": worker.environ().get("PROC_FD_AUDIT_LOG"),
            }
        )
    return {
        "executor": type(executor).__name__,
        "gcs_address": ray.get_runtime_context().gcs_address,
        "driver_node_id": ray.get_runtime_context().get_node_id(),
        "nodes": {n["NodeID"]: n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]},
        "local_readers": executor.rpc_broadcast_mq.n_local_reader,
        "remote_readers": executor.rpc_broadcast_mq.n_remote_reader,
        "ranks": ranks,
    }


def elastickv_cli(*args: str) -> dict[str, Any]:
    """Run the real ``elastickv`` console script (next to this interpreter) with ``--json``."""
    script = os.path.join(os.path.dirname(sys.executable), "elastickv")
    proc = subprocess.run(
        [script, *args, "--json"], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"elastickv {' '.join(args)} failed: {proc.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def _describe(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:160] or proc.name()
    except psutil.Error:
        return "?"


def _shutdown(llm: Any) -> dict[str, Any]:
    """Shut the engine down; report which of its child processes outlived it.

    Python's own ``multiprocessing`` resource tracker belongs to this (the calling) process
    and exits with it, so it is reported apart; the test checks it is gone afterwards.
    """
    children = psutil.Process().children(recursive=True)
    names = {p.pid: _describe(p) for p in children}
    engine = [p for p in children if "resource_tracker" not in names[p.pid]]
    start = time.monotonic()
    llm.llm_engine.engine_core.shutdown()
    _, alive = psutil.wait_procs(engine, timeout=20)
    return {
        "children": names,
        "left": {p.pid: names[p.pid] for p in alive},
        "stop_s": round(time.monotonic() - start, 1),
    }


def run(
    model: str,
    scenario: str,
    block_size: int,
    max_tokens: int,
    prefix_caching: bool,
    ledger_limit: str | None = None,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    distributed_executor_backend: str | None = None,
    barrier: tuple[Path, Path] | None = None,
) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    start = time.monotonic()
    llm = LLM(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=256,
        block_size=block_size,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
        enable_prefix_caching=prefix_caching,
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend=distributed_executor_backend,
    )
    startup_s = time.monotonic() - start
    if barrier is not None:
        # Started: say so, and serve only once told (tests that run engines together).
        ready, go = barrier
        ready.touch()
        deadline = time.monotonic() + 600
        while not go.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"never told to go ({go})")
            time.sleep(0.05)
    elastic = os.environ.get("ELASTICKV") == "1"
    placement = _ray_placement(llm) if distributed_executor_backend == "ray" and elastic else None
    stats, probe_fds = _probe(llm, elastic)
    core = _in_process_core(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    results: dict[str, list[int]] = {}
    preempted: dict[str, int] = {}
    samples: list[dict[str, Any]] = []
    idle = stats() if stats else None

    def step(sample: bool) -> None:
        for out in engine.step():
            if out.finished:
                results[out.request_id] = list(out.outputs[0].token_ids)
        if core is not None:
            for rid, request in core.scheduler.requests.items():
                preempted[rid] = max(preempted.get(rid, 0), request.num_preemptions)
        if sample and stats:
            samples.append(stats())

    result: dict[str, Any] = {
        "elastic": elastic,
        "startup_s": round(startup_s, 1),
        "runner_pid": os.getpid(),
        "ray_placement": placement,
    }
    start = time.monotonic()
    if scenario in ("functional", "all"):
        # Repeated prompts, one at a time: each completes before the next starts.
        for i, prompt in enumerate(FUNCTIONAL * 2):
            engine.add_request(f"f{i}", prompt, params)
            while engine.has_unfinished_requests():
                step(False)
        result["functional"] = [results[f"f{i}"] for i in range(len(FUNCTIONAL) * 2)]
    ledger = os.environ.get("ELASTICKV_LEDGER_DIR") and elastic
    if ledger:
        result["ledger_running"] = elastickv_cli("list")
    if ledger and ledger_limit is not None:
        # The engine is idle now: lower its limit; the next steps must honour it.
        (instance,) = result["ledger_running"]["instances"]
        result["footprint_before_limit"] = stats() if stats else None
        result["limit"] = elastickv_cli("limit", instance["name"], ledger_limit)
    if scenario in ("concurrent", "all", "long"):
        prompts = long_prompts(16) if scenario == "long" else concurrent_prompts(16)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"c{i}", prompt, params)
        while engine.has_unfinished_requests():
            step(True)
        result["concurrent"] = [results[f"c{i}"] for i in range(len(prompts))]
    result.update(
        num_blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        idle=idle,
        samples=samples,
        after=stats() if stats else None,
        preemptions=sum(preempted.values()) if core is not None else None,
        serve_s=round(time.monotonic() - start, 2),
    )
    for fd in probe_fds:
        os.close(fd)
    if ledger:
        result["ledger_served"] = elastickv_cli("list")
    result["shutdown"] = _shutdown(llm)
    if ledger:
        result["ledger_after"] = elastickv_cli("list")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("scenario", choices=["functional", "concurrent", "all", "long"])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--ledger-limit", help="`elastickv limit` this engine after warm-up")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--distributed-executor-backend", help="vLLM's default when not given")
    parser.add_argument(
        "--barrier",
        nargs=2,
        metavar=("READY", "GO"),
        type=Path,
        help="once the engine started, create READY, then wait until GO exists to serve",
    )
    parser.add_argument(
        "--scheduler-clock",
        action="store_true",
        help="count the scheduler's CPU time (ELASTICKV_SCHEDULER_CLOCK) and report it",
    )
    args = parser.parse_args()
    clock = None
    if args.scheduler_clock:
        from elastickv.integrations.vllm.config import SCHEDULER_CLOCK_VAR
        from elastickv.integrations.vllm.scheduler.scheduler_clock import create_clock_file

        clock = Path(tempfile.mkdtemp(prefix="elastickv-clock-")) / "scheduler.clock"
        create_clock_file(clock)
        os.environ[SCHEDULER_CLOCK_VAR] = str(clock)  # the engine core inherits it
    try:
        result = run(
            args.model,
            args.scenario,
            args.block_size,
            args.max_tokens,
            not args.no_prefix_caching,
            args.ledger_limit,
            args.tensor_parallel_size,
            args.dtype,
            args.distributed_executor_backend,
            args.barrier,
        )
        if clock is not None:
            from elastickv.integrations.vllm.scheduler.scheduler_clock import read_clock

            result["scheduler_clock"] = dataclasses.asdict(read_clock(clock))
    finally:
        if clock is not None:  # a failed run leaves nothing in /tmp either
            shutil.rmtree(clock.parent, ignore_errors=True)
    sys.stdout.write("\n" + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
