"""``bench_sleep.py`` refuses what it cannot run before any engine starts: ``--gpu`` on a host
without a CUDA GPU (this one), and ``--level`` without ``--gpu``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sleep.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu"], "--gpu needs an NVIDIA GPU and vLLM's CUDA build; none is visible here"),
        (["--level", "2"], "--level applies to --gpu"),
        (["--gpu", "--level", "3"], "argument --level: invalid choice: 3"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    import torch

    if args == ["--gpu"] and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: --gpu would run")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
