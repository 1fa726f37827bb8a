"""Tensor parallelism (TP=2) on elastic storage, real vLLM 0.32 with its multiprocess executor:
each worker rank holds its shard of the KV heads in its own pool, the scheduler commits a
block's pages on both ranks as one transaction. Compared with native vLLM TP=2 (in-process;
the elastic engine in-process and through the OpenAI server), under a budget that forces
refusals, and when a worker dies.
The engine tests are shared with vLLM 0.28 (:mod:`tp_tests`).

The two ranks run on the machine's two cores (``VLLM_CPU_OMP_THREADS_BIND="0|1"``: vLLM's
CPU workers refuse to share one NUMA node's threads without it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from plugin_harness import (
    ELASTIC,
    SERVER_MAX_TOKENS,
    TP,
    ledger_list,
    openai_server,
    pool_fds,
    serve,
    terminate,
)
from plugin_harness import TP_BIND as BIND
from tp_tests import (
    ALL,
    EngineRuns,
    test_tp2_budget_forces_refusals_ids_identical,
    test_tp2_each_rank_footprint_is_what_the_scheduler_committed,
    test_tp2_outputs_identical_to_native_tp2,
)

__all__ = [
    "test_tp2_budget_forces_refusals_ids_identical",
    "test_tp2_dead_worker_fails_the_engine_and_leaves_no_record",
    "test_tp2_each_rank_footprint_is_what_the_scheduler_committed",
    "test_tp2_outputs_identical_to_native_tp2",
    "test_tp2_server_completions_identical_to_native",
]


@pytest.fixture(scope="module")
def tp_server(cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    logs = tmp_path_factory.mktemp("tp-server-logs")
    tp: dict[str, str | None] = {"tensor-parallel-size": str(TP), "dtype": "float32"}
    return serve(cache_root, logs / "elastic.log", {**BIND, **ELASTIC}, tp)


def test_tp2_server_completions_identical_to_native(
    tp_server: dict[str, Any], runs: EngineRuns
) -> None:
    """The server's prompts and engine arguments are the engine tests' (the same prompts, one
    at a time, then 16 at once; float32, whose greedy ids do not depend on the batch), so
    native vLLM TP=2's run of them is the reference: its first tokens of each."""
    elastic = tp_server
    native = runs("tiny-llama", *ALL, **BIND)
    assert elastic["health"] == 200
    # Each worker maps its own pool; the engine core holds none (it grants pages).
    assert elastic["pool_holders"] == TP
    assert elastic["functional"] == [ids[:SERVER_MAX_TOKENS] for ids in native["functional"]]
    assert len(elastic["outputs"]) == 16
    assert [o["token_ids"] for o in elastic["outputs"]] == [
        ids[:SERVER_MAX_TOKENS] for ids in native["concurrent"]
    ]
    assert "every page granted to its 2 tensor-parallel ranks" in elastic["log"]
    (instance,) = elastic["ledger"]
    assert instance["alive"]
    assert elastic["ledger_after"] == [] and not elastic["shutdown"]["left"]


def _serving(server: Any) -> bool:
    """The server process runs and answers ``/health`` with 200."""
    if server.proc.poll() is not None:
        return False
    try:
        return bool(server.get_status("/health") == 200)
    except OSError:
        return False


def test_tp2_dead_worker_fails_the_engine_and_leaves_no_record(
    cache_root: Path, tmp_path: Path
) -> None:
    """``kill -9`` of one worker rank: vLLM's executor fails the engine (the server stops
    serving), and the engine's ledger record does not outlive it."""
    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    ledger_dir = cache_root / "ledger"
    with openai_server(
        cache_root,
        model,
        {**BIND, **ELASTIC},
        tmp_path / "server.log",
        {"tensor-parallel-size": str(TP), "dtype": "float32"},
    ) as server:
        assert len(server.complete("Hello, my name is", 8)["token_ids"]) == 8
        (instance,) = ledger_list(ledger_dir)["instances"]
        assert instance["committed_bytes"] > 0
        holders = pool_fds(list(server.descendants))
        workers = [pid for pid in holders if "Worker" in server.descendants.get(pid, "")]
        assert len(workers) == TP, server.descendants
        os.kill(workers[-1], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while _serving(server) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _serving(server), server.log.read_text(errors="replace")[-3000:]
        if server.proc.poll() is None:
            terminate(server, timeout=60)
    deadline = time.monotonic() + 30
    while (left := ledger_list(ledger_dir)["instances"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], left
    survivors = []
    for pid in server.descendants:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                survivors.append(pid)
    assert survivors == []
