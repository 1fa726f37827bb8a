"""``benchmarks/bench_alloc.py`` runs on this vLLM (a small geometry, a few iterations):
its block-pool row drives ``ElasticBlockPool`` through the per-step hooks' entry points,
which a change to them must keep it calling correctly. The numbers are not checked here
(timing belongs to the benchmark, not to a test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_alloc_runs_its_block_pool_row() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_alloc.py"),
            *("--blocks", "512", "--layers", "2", "--iterations", "32", "--rounds", "1"),
            *("--cold-iterations", "1", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["vllm_baseline"] == "vllm.v1.core.block_pool.BlockPool"
    row = report["block_pool"]
    assert row["workload"] == "scheduler step (16 requests)"
    assert row["elastic_us_per_step"] > 0 and row["vllm_us_per_step"] > 0
