"""``benchmarks/gpu_check.py`` without a GPU: exactly one SKIP line naming what it needs, exit
status 0, and a JSON file that says "skip" (never a pass). Its checks themselves run against
the fake driver in tests/cuda_fake/test_cuda_fake_gpu_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def run(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make gpu-check runs it")
def test_no_gpu_is_one_skip_line_and_exit_0(tmp_path: Path) -> None:
    done = run(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    assert lines[0].startswith("SKIP gpu-check: needs PyTorch with CUDA and a visible GPU (")
    assert torch.__version__ in lines[0]
    written = json.loads((tmp_path / "gpu-check.json").read_text())
    assert written["status"] == "skip" and written["checks"] == []
    assert written["reason"] in lines[0]


def test_json_path_is_taken_from_the_option(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: make gpu-check runs it")
    target = tmp_path / "deeper" / "result.json"
    done = run(tmp_path, "--json", str(target))
    assert done.returncode == 0, done.stderr
    assert json.loads(target.read_text())["status"] == "skip"
    assert not (tmp_path / "gpu-check.json").exists()


def test_no_pytorch_at_all_is_a_skip_too(tmp_path: Path) -> None:
    """An interpreter without torch (a stand-in package that is not importable)."""
    stand_in = tmp_path / "no-torch" / "torch"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stand_in.parent), env.get("PYTHONPATH")]))
    done = run(tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "SKIP gpu-check: needs PyTorch with CUDA (torch is not installed)"
    ]
