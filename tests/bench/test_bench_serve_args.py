"""``benchmarks/bench_serve.py``'s arguments: what it refuses before anything starts (its
runs themselves start real vLLM engines for minutes: run by hand, see docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"


def bench_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_a_budget_the_static_arm_cannot_start_under_is_refused_first() -> None:
    """4608K (the default until serve ran each built-in model in its own dtype) gives each
    model 1536K; native vLLM needs 13 blocks of 128 KiB for the float32 deep model (12 for a
    384-token request, one it keeps for itself), so the static arm died at start-up."""
    done = bench_serve("--quick", "--budget", "4608K")
    assert done.returncode == 2, done
    assert "tiny-llama-deep needs 1664K" in done.stderr, done.stderr
    assert "use --budget 4992K or more" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeat", "0"], "--repeat must be at least 1"),
        (["--budget", "12Q"], "--budget: invalid size '12Q'"),
        (["--workloads", "ramp,flood"], "unknown workload(s) flood"),
        (["--sweep", "--repeat", "2"], "--repeat must be odd with --sweep"),
        (["--sweep", "--slo", "0"], "--slo must be a positive number of seconds"),
        (["--sweep", "--resolution", "1"], "--resolution must be above 1"),
        (["--sweep", "--budget", "8M"], "--budget and --sweep exclude each other"),
        (["--sweep", "--sweep-max", "2M"], "below the smallest budget the static arm starts"),
        (["--sweep", "--sweep-max", "9Q"], "--sweep-max: invalid size '9Q'"),
        (["--sweep", "--arms", "static,gpu"], "--arms takes static, elastic or both"),
        (["--arms", "elastic"], "--arms chooses the arms of --sweep or --fit"),
        (["--fit", "--sweep"], "--sweep and --fit exclude each other"),
        (["--fit", "--repeat", "2"], "--repeat must be odd with --fit"),
        (["--fit", "--fit-max", "0"], "--fit-max must be at least 1"),
        (["--fit", "--budget", "256K"], "--budget 256K starts no model in the static arm"),
        (["--fit", "--arms", "elastic", "--budget", "256K"], "no model in the elastic arm"),
        (["--fit", "--plot", "fit.png"], "--fit draws no picture"),
    ],
)
def test_bad_arguments_are_one_clear_line(args: list[str], message: str) -> None:
    done = bench_serve(*args)
    assert done.returncode == 2, done
    assert message in done.stderr.splitlines()[-1], done.stderr
