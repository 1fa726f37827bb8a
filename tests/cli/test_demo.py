"""``elastickv demo`` (what ``make demo`` runs) for real: ``elastickv serve`` with the built-in
models on real vLLM (the project's cached vLLM 0.32 environment), a bursty load, the picture,
the summary, and nothing left running afterwards."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from elastickv.cli.demo import MODELS
from elastickv.serve.python_env import find_engine_python

pytestmark = pytest.mark.vllm

# Every process the demo starts (serve, and each engine in a session of its own) inherits it.
TOKEN_VAR = "EKV_TEST_DEMO_TOKEN"


def carrying(token: str) -> list[str]:
    """Live processes whose environment carries ``token``."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(TOKEN_VAR) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
    return found


def test_demo_serves_the_load_and_leaves_nothing_running(tmp_path: Path) -> None:
    python = find_engine_python()  # fails (no skip) when the vLLM environment is missing
    plot = tmp_path / "demo.png"
    token = uuid.uuid4().hex
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "COLUMNS": "100",
        TOKEN_VAR: token,
    }
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
    # The demo watches until every model released its KV; its last status line shows it.
    assert summary[2].startswith(f"3. idle models released their KV ({', '.join(MODELS)})")
    assert "kv-released" in stdout
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert carrying(token) == []  # serve and every engine, each in a session of its own
