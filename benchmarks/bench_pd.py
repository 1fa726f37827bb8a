"""Prefill/decode disaggregation on elastic storage against one elastic engine, same workload,
one run (vLLM 0.32, ``NixlConnector`` over UCX on one host).

Three OpenAI servers of the same tiny float32 model, all ``ELASTICKV=1``, in two phases, one
after the other, so each side has the machine's two cores to itself:

* **one engine** — serves the workload alone, bound to both cores
  (``VLLM_CPU_OMP_THREADS_BIND=0-1``): the baseline;
* **the P/D pair** — a prefill engine on core 0 and a decode engine on core 1, each with its
  own NIXL side channel, driven by a router inside this script that does the two-step
  exchange of ``docs/pd.md``: the prompt to the prefill engine (``max_tokens: 1``,
  ``do_remote_decode``), then the prompt, the real ``max_tokens`` and the prefill response's
  ``kv_transfer_params`` to the decode engine, which reads the prompt's blocks from the
  prefiller's pool with NIXL and decodes. TTFT counts from sending the prefill request to the
  decode stream's first token: what a client of the router waits.

The sides do not run side by side, so that each has the cores to itself. An engine with the
NIXL connector is not idle when it has no request unless its NIXL progress thread waits for
events (elastickv's default on the CPU backend; ``--nixl-progress-wait-ms 0`` gives the pair
NIXL's own spinning thread instead, a core per engine, reported as ``idle_cores_busy``).

Workload: ``--requests`` prompts of seeded random token ids, 100-300 tokens each (4 to 10
blocks of 32: a transfer moves several whole blocks), greedy, ``ignore_eos``, ``--max-tokens``
each, streamed, ``--concurrency`` in flight (closed loop): one untimed warm-up wave per side
(it also pays the pair's NIXL handshake), 5 s idle (the engines' idle CPU), then ``--passes``
timed passes.

Reported: per side TTFT mean/p50/p99, output tokens/s (median over passes), time per output
token, each engine's CPU seconds per pass and idle; the ratios pair / one engine; greedy
outputs, which must be equal between the sides for every prompt (a mismatch is printed loudly
and the exit status is 1). For the transfers:
NIXL's own per-transfer telemetry as the decode engine exports it on ``/metrics``
(``vllm:nixl_xfer_time_seconds``, ``vllm:nixl_bytes_transferred``,
``vllm:nixl_num_descriptors``; counted from a scrape taken before the timed passes): bytes
moved per request, transfer time per block (the transfers' total time over the blocks they
moved) and per transfer (mean; p50/p99 estimated from the histogram's buckets, so no finer
than its 5 ms lowest bound), checked against the blocks the prefill responses named
(``remote_block_ids``) times the bytes a block holds. A transfer's time is as NIXL reports
it: from posting the read until vLLM, polling once per engine step, sees it done.

Both pair engines and the baseline are stopped with SIGTERM and their process trees awaited;
the private ledger must be empty afterwards.

    .venvs/vllm-0.32/bin/python benchmarks/bench_pd.py [--json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from elastickv.bench.client import PrepareError, Result, run_closed
from elastickv.bench.monitor import Histogram, histogram, machine_report
from elastickv.bench.stats import bucket_quantile, latency_summary
from elastickv.bench.vllm_server import (
    HOST,
    Server,
    cpu_seconds,
    hermetic_env,
    ledger_env,
    scrape_metrics,
    server,
    stop,
    vllm_version,
)
from elastickv.bench.workloads import Arrival, batch
from elastickv.ports import free_port
from elastickv.serve.pd import PREFILL_TRANSFER_PARAMS

BLOCK = 32
PROMPT_TOKENS = (100, 300)
KV_CACHE_BYTES = 64 << 20
ELASTIC_ENV = {"ELASTICKV": "1", "ELASTICKV_VIRTUAL_CAPACITY": str(KV_CACHE_BYTES)}
SERVER_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "384",
    "--enforce-eager",
    "--block-size",
    str(BLOCK),
    "--kv-cache-memory-bytes",
    str(KV_CACHE_BYTES),
    # Host memory on the CPU backend: vLLM refuses to start another engine while free memory
    # is below this share; with elastic storage the capacity is virtual anyway.
    "--gpu-memory-utilization",
    "0.2",
    "--no-enable-prefix-caching",
    "--seed",
    "0",
]
# The prefiller keeps a prompt's blocks for the decoder for a lease (30 s by default); a
# loaded machine can exceed it, and an expired lease decodes wrong tokens (docs/pd.md).
KV_TRANSFER = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {"kv_lease_duration": 300},
}
XFER_TIME = "vllm:nixl_xfer_time_seconds"
POST_TIME = "vllm:nixl_post_time_seconds"
XFER_BYTES = "vllm:nixl_bytes_transferred"
DESCRIPTORS = "vllm:nixl_num_descriptors"
SIDES = ("one", "pair")
ENGINES = {"one": ("one",), "pair": ("prefill", "decode")}  # the last one is sent requests
IDLE_S = 5.0


def block_bytes(model: Path) -> int:
    """Bytes of KV one block holds (all layers, K and V), from the model's config."""
    config = json.loads((model / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[config.get("torch_dtype", "float32")]
    return int(config["num_hidden_layers"] * 2 * kv_heads * head * item * BLOCK)


def count_blocks(ids: Any) -> int:
    """Blocks in ``remote_block_ids``: a list, or one list per KV cache group."""
    if not ids:
        return 0
    return sum(count_blocks(i) if isinstance(i, list) else 1 for i in ids)


class Router:
    """The P/D router's first step, as a ``prepare`` for the decode request: the prefill
    request, and its ``kv_transfer_params`` for the decode request's body. Keeps, per
    request, the blocks the prefiller named and how long its request took."""

    def __init__(self, prefill: Server) -> None:
        self.base = f"http://{HOST}:{prefill.port}"
        self.model = prefill.model
        self.prefills: list[dict[str, float]] = []

    async def __call__(self, session: aiohttp.ClientSession, arrival: Arrival) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": list(arrival.prompt),
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": PREFILL_TRANSFER_PARAMS,
        }
        start = time.monotonic()
        async with session.post(self.base + "/v1/completions", json=body) as response:
            if response.status != 200:
                text = await response.text()
                raise PrepareError(f"prefill HTTP {response.status}: {text[:300]}")
            answer = await response.json()
        params = answer.get("kv_transfer_params")
        if not params or not params.get("remote_block_ids"):
            raise PrepareError(f"the prefill response names no blocks: {str(answer)[:300]}")
        blocks = count_blocks(params["remote_block_ids"])
        self.prefills.append({"seconds": time.monotonic() - start, "blocks": blocks})
        return {"kv_transfer_params": params}


def nixl_histograms(srv: Server) -> dict[str, Histogram]:
    text = scrape_metrics(srv)
    return {name: histogram(text, name) for name in (XFER_TIME, POST_TIME, XFER_BYTES, DESCRIPTORS)}


def one_pass(
    srv: Server, work: list[Arrival], concurrency: int, router: Router | None
) -> tuple[list[Result], float]:
    """One wave of ``work`` at ``srv`` (through ``router``'s prefill step, if any)."""
    return asyncio.run(run_closed(f"http://{HOST}:{srv.port}", work, concurrency, prepare=router))


def transfers(
    before: dict[str, Histogram],
    after: dict[str, Histogram],
    prefills: list[dict[str, float]],
    requests: int,
    per_block: int,
) -> dict[str, Any]:
    """What the decode engine's NIXL reads of the timed passes moved, and how fast."""
    grown = {name: after[name] - before[name] for name in after}
    count = grown[XFER_TIME].count
    blocks = sum(p["blocks"] for p in prefills)
    moved = grown[XFER_BYTES].sum
    ms = 1e3

    def quantile(q: float) -> float | None:
        value = bucket_quantile(grown[XFER_TIME].buckets, q)
        return None if value is None else value * ms

    def ceiling(q: float) -> float | None:
        """The upper bound of the bucket the ``q`` quantile falls in (ms)."""
        buckets = grown[XFER_TIME].buckets
        total = buckets[-1][1] if buckets else 0.0
        for bound, cumulative in buckets:
            if total and cumulative >= q * total:
                return bound * ms
        return None

    return {
        "requests": requests,
        "transfers": int(count),
        "blocks_named": blocks,
        "blocks_per_request_mean": blocks / len(prefills) if prefills else None,
        "bytes_moved": int(moved),
        "bytes_per_request": moved / requests if requests else None,
        "bytes_per_block_measured": moved / blocks if blocks else None,
        "bytes_per_block_expected": per_block,
        "bytes_named": blocks * per_block,
        "xfer_ms_per_block_mean": grown[XFER_TIME].sum / blocks * ms if blocks else None,
        "xfer_ms_per_transfer_mean": grown[XFER_TIME].sum / count * ms if count else None,
        "xfer_ms_per_transfer_p50_estimate": quantile(0.5),
        "xfer_ms_per_transfer_p99_estimate": quantile(0.99),
        "xfer_ms_per_transfer_p50_at_most": ceiling(0.5),
        "xfer_ms_per_transfer_p99_at_most": ceiling(0.99),
        "post_ms_per_transfer_mean": grown[POST_TIME].sum / count * ms if count else None,
        "descriptors_per_transfer_mean": grown[DESCRIPTORS].sum / count if count else None,
        "throughput_mib_s": moved / grown[XFER_TIME].sum / (1 << 20)
        if grown[XFER_TIME].sum
        else None,
        "prefill_request_ms_mean": statistics.fmean(p["seconds"] for p in prefills) * ms
        if prefills
        else None,
    }


def side_summary(results: list[Result], passes: list[dict[str, float]]) -> dict[str, Any]:
    summary = latency_summary(results)
    ms = {k: None if v is None else v * 1e3 for k, v in summary.items() if isinstance(v, float)}
    return {
        "tokens_per_s": statistics.median(p["tokens_per_s"] for p in passes),
        "ttft_mean_ms": ms.get("ttft_mean"),
        "ttft_p50_ms": ms.get("ttft_p50"),
        "ttft_p99_ms": ms.get("ttft_p99"),
        "tpot_mean_ms": ms.get("tpot_mean"),
        "e2e_mean_ms": ms.get("e2e_mean"),
        "requests": summary["requests"],
        "failed": summary["failed"],
        "errors": summary["errors"],
    }


def ledger_instances(directory: Path) -> list[dict[str, Any]]:
    from elastickv.control.api import list_instances

    try:
        return [asdict(i) for i in list_instances(directory=str(directory))]
    except FileNotFoundError:  # no elastic engine ever registered there
        return []


def run_side(
    side: str,
    model: str,
    plans: dict[str, tuple[dict[str, str], list[str]]],
    elastic: dict[str, str],
    tmp: Path,
    work: list[Arrival],
    warmup: list[Arrival],
    args: argparse.Namespace,
    passes: int,
) -> dict[str, Any]:
    """Start one side's engines, warm them up, measure their idle CPU, run the timed passes,
    stop them; the private ledger must then hold none of them."""
    out: dict[str, Any] = {"results": [], "passes": [], "startup_s": {}, "stops": {}, "cpu": {}}
    ledger = tmp / "ledger"
    with contextlib.ExitStack() as stack:
        servers: dict[str, Server] = {}
        for name in ENGINES[side]:
            extra, server_args = plans[name]
            env = hermetic_env(tmp / f"vllm-cache-{name}", {**elastic, **extra})
            servers[name], startup = stack.enter_context(
                server(model, env, tmp / f"{name}.log", server_args)
            )
            out["startup_s"][name] = round(startup, 1)
            print(f"{name} up in {startup:.1f} s", file=sys.stderr)
        router = Router(servers["prefill"]) if side == "pair" else None
        target = servers[ENGINES[side][-1]]
        # Untimed; for the pair, the first request also pays the NIXL handshake.
        done, _ = one_pass(target, warmup, args.concurrency, router)
        if any(not r.ok for r in done):
            raise RuntimeError(f"{side} warm-up failed: {latency_summary(done)['errors']}")
        cpu0 = {name: sum(cpu_seconds(srv).values()) for name, srv in servers.items()}
        time.sleep(IDLE_S)
        cpu1 = {name: sum(cpu_seconds(srv).values()) for name, srv in servers.items()}
        if router is not None:
            router.prefills.clear()
            out["before"] = nixl_histograms(servers["decode"])
        for number in range(passes):
            done, seconds = one_pass(target, work, args.concurrency, router)
            tokens = sum(r.tokens for r in done)
            out["results"].append(done)
            out["passes"].append({"seconds": seconds, "tokens_per_s": tokens / seconds})
            print(f"{side} pass {number}: {tokens / seconds:.1f} tok/s", file=sys.stderr)
        cpu2 = {name: sum(cpu_seconds(srv).values()) for name, srv in servers.items()}
        for name in servers:
            out["cpu"][name] = {
                "idle_cores_busy": round((cpu1[name] - cpu0[name]) / IDLE_S, 2),
                "cpu_s_per_pass": round((cpu2[name] - cpu1[name]) / passes, 2),
            }
        if router is not None:
            out["after"] = nixl_histograms(servers["decode"])
            out["router"] = router
        out["serving"] = ledger_instances(ledger)
        for name in reversed(ENGINES[side]):
            stop_s, left = stop(servers[name])
            out["stops"][name] = {"stop_s": round(stop_s, 2), "left_processes": left}
    out["ledger_left"] = [i["name"] for i in ledger_instances(ledger)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="16 requests x 32 tokens, 2 passes per side"
    )
    parser.add_argument("--model", default="tiny-llama", help="built-in tiny model name")
    parser.add_argument("--requests", type=int, default=None, help="requests per pass (32)")
    parser.add_argument("--concurrency", type=int, default=8, help="in flight at once (8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (64)")
    parser.add_argument("--passes", type=int, default=None, help="timed passes per side (4)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the server logs")
    parser.add_argument(
        "--nixl-progress-wait-ms",
        type=int,
        default=None,
        help="the pair's ELASTICKV_NIXL_PROGRESS_WAIT_MS (default: elastickv's, 5 ms on the "
        "CPU backend; 0: NIXL's spinning progress thread)",
    )
    args = parser.parse_args()
    if vllm_version() is None:
        parser.error("vLLM is not installed in this interpreter; run it with the vLLM venv")
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("the P/D pair binds its engines to cores 0 and 1: 2 CPUs needed")
    requests = args.requests or (16 if args.quick else 32)
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    passes = args.passes or (2 if args.quick else 4)

    from elastickv.models import ensure_tiny_model

    model_dir = ensure_tiny_model(args.model)
    model = str(model_dir)
    work = batch(model, requests, prompt_tokens=PROMPT_TOKENS, max_tokens=max_tokens, seed=0)
    warmup = batch(model, args.concurrency, prompt_tokens=PROMPT_TOKENS, max_tokens=8, seed=1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    ledger = tmp / "ledger"
    ledger.mkdir(mode=0o700)
    elastic = {**ELASTIC_ENV, **ledger_env(ledger)}
    transfer = ["--kv-transfer-config", json.dumps(KV_TRANSFER)]
    wait_ms = args.nixl_progress_wait_ms
    pair_env = {} if wait_ms is None else {"ELASTICKV_NIXL_PROGRESS_WAIT_MS": str(wait_ms)}
    plans = {
        "one": ({"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, SERVER_ARGS),
        "prefill": (
            {
                "VLLM_CPU_OMP_THREADS_BIND": "0",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                **pair_env,
            },
            SERVER_ARGS + transfer,
        ),
        "decode": (
            {
                "VLLM_CPU_OMP_THREADS_BIND": "1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                **pair_env,
            },
            SERVER_ARGS + transfer,
        ),
    }
    load_before = os.getloadavg()
    begin = time.monotonic()
    runs: dict[str, dict[str, Any]] = {}
    try:
        for side in SIDES:  # one after the other: each side has the cores to itself
            runs[side] = run_side(side, model, plans, elastic, tmp, work, warmup, args, passes)
    finally:
        if args.keep_logs:
            print(f"server logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    results = {side: runs[side]["results"] for side in SIDES}
    stops = {name: stop for side in SIDES for name, stop in runs[side]["stops"].items()}
    left_in_ledger = runs["pair"]["ledger_left"] + runs["one"]["ledger_left"]
    router: Router = runs["pair"]["router"]

    sides = {
        side: side_summary([r for done in results[side] for r in done], runs[side]["passes"])
        for side in SIDES
    }
    reference = [r.text for r in results["one"][0]]
    differing = sorted(
        {
            i
            for side in SIDES
            for done in results[side]
            for i, r in enumerate(done)
            if r.text != reference[i]
        }
    )

    def ratio(key: str) -> float | None:
        one, pair = sides["one"][key], sides["pair"][key]
        return None if not one or pair is None else round(pair / one, 3)

    report: dict[str, Any] = {
        "vllm": vllm_version(),
        "model": args.model,
        "workload": {
            "requests": requests,
            "concurrency": args.concurrency,
            "max_tokens": max_tokens,
            "prompt_tokens": list(PROMPT_TOKENS),
            "prompt_tokens_mean": statistics.fmean(len(a.prompt) for a in work),
            "passes": passes,
            "block_size": BLOCK,
            "temperature": 0,
            "ignore_eos": True,
        },
        "server_args": SERVER_ARGS,
        "kv_transfer_config": KV_TRANSFER,
        "elastic_env": ELASTIC_ENV,
        "pair_env": pair_env,
        "sides": sides,
        "ratios_pair_over_one": {
            "throughput": ratio("tokens_per_s"),
            "ttft_mean": ratio("ttft_mean_ms"),
            "ttft_p50": ratio("ttft_p50_ms"),
            "ttft_p99": ratio("ttft_p99_ms"),
            "tpot_mean": ratio("tpot_mean_ms"),
        },
        "transfer": transfers(
            runs["pair"]["before"],
            runs["pair"]["after"],
            router.prefills,
            requests * passes,
            block_bytes(model_dir),
        ),
        "greedy_identical": not differing,
        "greedy_differing_prompts": differing,
        "all_tokens_received": all(r.ok for side in SIDES for done in results[side] for r in done),
        "startup_s": {k: v for side in SIDES for k, v in runs[side]["startup_s"].items()},
        "cpu": {name: cpu for side in SIDES for name, cpu in runs[side]["cpu"].items()},
        "stop": stops,
        "clean_shutdown": all(s["left_processes"] == 0 for s in stops.values()),
        "ledger_while_serving": [
            {k: i[k] for k in ("name", "committed_bytes", "peak_bytes", "refusals")}
            for side in SIDES
            for i in runs[side]["serving"]
        ],
        "ledger_left": left_in_ledger,
        "passes": {side: runs[side]["passes"] for side in SIDES},
        "machine": machine_report(load_before),
        "wall_s": round(time.monotonic() - begin, 1),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_tables(report)
    ok = (
        report["greedy_identical"]
        and report["all_tokens_received"]
        and report["clean_shutdown"]
        and not report["ledger_left"]
    )
    if not report["greedy_identical"]:
        print(
            f"GREEDY OUTPUTS DIFFER between the P/D pair and one engine for "
            f"{len(differing)} of {requests} prompts: {differing}",
            file=sys.stderr,
        )
    return 0 if ok else 1


def print_tables(report: dict[str, Any]) -> None:
    from rich.table import Table

    from elastickv.cli.tables import output_console, print_table

    console = output_console()
    work = report["workload"]
    title = (
        f"vLLM {report['vllm']}, {report['model']}: P/D pair (prefill core 0, decode core 1, "
        f"NIXL) against one engine (cores 0-1), all elastic; {work['requests']} requests of "
        f"{work['prompt_tokens'][0]}-{work['prompt_tokens'][1]} prompt tokens x "
        f"{work['max_tokens']} tokens at concurrency {work['concurrency']}, "
        f"{work['passes']} passes per side"
    )
    table = Table(title=title)
    for column in ("metric", "one engine", "P/D pair", "pair/one"):
        table.add_column(column)
    sides, ratios = report["sides"], report["ratios_pair_over_one"]
    rows = [
        ("output tokens/s (median pass)", "tokens_per_s", "throughput"),
        ("TTFT mean, ms", "ttft_mean_ms", "ttft_mean"),
        ("TTFT p50, ms", "ttft_p50_ms", "ttft_p50"),
        ("TTFT p99, ms", "ttft_p99_ms", "ttft_p99"),
        ("time per output token, ms", "tpot_mean_ms", "tpot_mean"),
    ]

    def fmt(value: float | None, spec: str = ".1f") -> str:
        return "-" if value is None else format(value, spec)

    for label, key, ratio in rows:
        table.add_row(
            label, fmt(sides["one"][key]), fmt(sides["pair"][key]), fmt(ratios[ratio], ".3f")
        )
    print_table(console, table)
    t = report["transfer"]
    transfers = Table(title="NIXL reads by the decode engine, timed passes (its /metrics)")
    transfers.add_column("metric")
    transfers.add_column("value")
    transfers.add_row("transfers / requests", f"{t['transfers']} / {t['requests']}")
    transfers.add_row("blocks per request (prefill responses)", fmt(t["blocks_per_request_mean"]))
    transfers.add_row("bytes moved per request", fmt(t["bytes_per_request"], ".0f"))
    transfers.add_row(
        "bytes per block: measured / expected",
        f"{fmt(t['bytes_per_block_measured'], '.0f')} / {t['bytes_per_block_expected']}",
    )
    transfers.add_row("transfer time per block, mean ms", fmt(t["xfer_ms_per_block_mean"], ".3f"))
    transfers.add_row(
        "transfer time per transfer, mean ms", fmt(t["xfer_ms_per_transfer_mean"], ".3f")
    )
    transfers.add_row(
        "  p50 / p99 ms (histogram buckets)",
        f"≤ {fmt(t['xfer_ms_per_transfer_p50_at_most'], 'g')} / "
        f"≤ {fmt(t['xfer_ms_per_transfer_p99_at_most'], 'g')}",
    )
    transfers.add_row("descriptors per transfer", fmt(t["descriptors_per_transfer_mean"]))
    transfers.add_row("transfer throughput, MiB/s", fmt(t["throughput_mib_s"]))
    transfers.add_row("prefill request (router step 1), mean ms", fmt(t["prefill_request_ms_mean"]))
    print_table(console, transfers)
    for name, cpu in report["cpu"].items():
        console.print(
            f"{name}: {cpu['cpu_s_per_pass']:.2f} CPU s per timed pass; "
            f"with no request, {cpu['idle_cores_busy']:.2f} cores busy"
        )
    if not report["greedy_identical"]:
        console.print(
            f"[bold red]GREEDY OUTPUTS DIFFER for prompts {report['greedy_differing_prompts']}"
        )
    console.print(
        f"greedy outputs identical: {report['greedy_identical']}; "
        f"all tokens received: {report['all_tokens_received']}; "
        f"clean shutdown: {report['clean_shutdown']}; "
        f"ledger left: {report['ledger_left'] or 'none'}; "
        f"load average {report['machine']['loadavg_before']} -> "
        f"{report['machine']['loadavg_after']} on {report['machine']['cpus']} CPUs"
    )


if __name__ == "__main__":
    raise SystemExit(main())
