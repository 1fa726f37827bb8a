"""Start-up time and memory of a vLLM server with elastickv, by virtual capacity, against
native vLLM in the same run.

Why: vLLM builds one Python object per KV block when an engine starts, so a block count that
followed the *virtual* capacity made start-up grow with it (1 TiB of a tiny model: 32M
blocks, 120 s, 5.1 GB). elastickv now never advertises more blocks than the engine can use
at once (``max_num_seqs`` requests of ``max_model_len`` tokens); this measures that start-up
no longer depends on the virtual capacity.

    .venv/bin/python benchmarks/bench_startup.py [--capacities 8G,64G,1T] [--json]

Each run: ``vllm.entrypoints.openai.api_server`` with ``tiny-llama`` in its own session,
timed from launch to ``/health`` = 200; memory = the RSS and PSS summed over every process
of the session once ready; blocks = what vLLM reports for its KV cache; then SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from elastickv.models import ensure_tiny_model
from elastickv.ports import free_port
from elastickv.serve.engine import session_processes, stop_session
from elastickv.serve.python_env import find_engine_python
from elastickv.units import format_bytes, parse_size

# vLLM's CPU worker refuses to start unless the free host memory covers
# --gpu-memory-utilization (0.92 by default) of it; half leaves room on a shared machine.
ENGINE_ARGS = ["--enforce-eager", "--max-model-len", "256", "--block-size", "32"]
ENGINE_ARGS += ["--gpu-memory-utilization", "0.5"]
# vLLM's own line (both series) and elastickv's start-up line: the KV blocks built.
BLOCKS = (re.compile(r"KV cache size: ([\d,]+) tokens"), re.compile(r"(\d+) KV blocks in"))


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def memory_of(sid: int) -> tuple[int, int]:
    """RSS and PSS summed over the live processes of session ``sid``."""
    rss = pss = 0
    for proc in session_processes(sid):
        with contextlib.suppress(psutil.Error):
            info = proc.memory_full_info()
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
    return rss, pss


def one_run(python: str, model: str, work: Path, capacity: str | None) -> dict[str, Any]:
    """One server start (``capacity`` None: native vLLM)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")}
    env.update(VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(work / "cache"))
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS]
    if capacity is None:
        argv += ["--kv-cache-memory-bytes", str(64 << 20)]
    else:
        env.update(
            ELASTICKV="1",
            ELASTICKV_VIRTUAL_CAPACITY=capacity,
            ELASTICKV_LEDGER_DIR=str(work / "ledger"),
        )
    log = work / f"server-{capacity or 'native'}.log"
    started = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() - started > 600:
                raise SystemExit(f"server ({capacity or 'native'}) did not start:\n"
                                 f"{log.read_text(errors='replace')[-3000:]}")  # fmt: skip
            time.sleep(0.25)
        ready_s = time.monotonic() - started
        rss, pss = memory_of(proc.pid)
    finally:
        stop_session(proc)
    text = log.read_text(errors="replace")
    tokens = BLOCKS[0].search(text)
    blocks = BLOCKS[1].search(text)
    return {
        "arm": "native" if capacity is None else f"elastickv {capacity}",
        "virtual_capacity_bytes": None if capacity is None else parse_size(capacity),
        "startup_s": round(ready_s, 1),
        "rss_bytes": rss,
        "pss_bytes": pss,
        "kv_tokens": None if tokens is None else int(tokens.group(1).replace(",", "")),
        "kv_blocks": None if blocks is None else int(blocks.group(1)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacities", default="8G,64G,1T", help="comma-separated sizes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    capacities = [c.strip() for c in args.capacities.split(",") if c.strip()]
    for capacity in capacities:
        parse_size(capacity)  # a bad size fails before anything starts
    python = str(find_engine_python())
    model = str(ensure_tiny_model("tiny-llama"))
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        runs = [one_run(python, model, Path(tmp), None)]
        runs += [one_run(python, model, Path(tmp), c) for c in capacities]
    native = runs[0]
    for run in runs:
        run["startup_ratio"] = round(run["startup_s"] / native["startup_s"], 2)
        run["pss_ratio"] = round(run["pss_bytes"] / native["pss_bytes"], 2)
    if args.json:
        print(json.dumps({"model": "tiny-llama", "runs": runs}))
        return 0
    print(f"{'arm':<20} {'start-up':>9} {'vs native':>9} {'RSS':>10} {'PSS':>10} "
          f"{'vs native':>9} {'KV blocks':>10}")  # fmt: skip
    for run in runs:
        print(
            f"{run['arm']:<20} {run['startup_s']:>8.1f}s {run['startup_ratio']:>8.2f}x "
            f"{format_bytes(run['rss_bytes']):>10} {format_bytes(run['pss_bytes']):>10} "
            f"{run['pss_ratio']:>8.2f}x {run['kv_blocks'] or '-':>10}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
