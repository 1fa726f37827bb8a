"""``elastickv demo`` (what ``make demo`` runs) for real: ``elastickv serve`` with the built-in
models on real vLLM (the project's cached vLLM 0.32 environment), a bursty load, the picture,
the summary, and nothing left running afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elastickv.serve.engine import session_processes
from elastickv.serve.python_env import find_engine_python


def test_demo_serves_the_load_and_leaves_nothing_running(tmp_path: Path) -> None:
    python = find_engine_python()  # fails (no skip) when the vLLM environment is missing
    plot = tmp_path / "demo.png"
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), COLUMNS="100")
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastickv.cli.main", "demo", "--peak", "3", "--plot", str(plot),
         "--python", python],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "stopped elastickv serve: nothing left running" in stdout
    summary = [line for line in stdout.splitlines() if line[:3] in ("1. ", "2. ", "3. ")]
    assert len(summary) == 3, stdout
    assert summary[0].startswith("1. 18/18 requests served, 0 failed")
    assert "kv-released" in stdout  # the live lines show a model releasing its KV
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert session_processes(proc.pid) == []
