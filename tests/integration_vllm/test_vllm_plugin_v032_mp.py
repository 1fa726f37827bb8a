"""elastickv in vLLM 0.32's default multiprocess mode: the scheduler (engine core process)
grants the pages of the KV cache the worker process maps in its own memory; compared with
native multiprocess vLLM on one engine per side (functional prompts, then 16 concurrent
requests). No engine process opens another's memory."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import psutil
from plugin_harness import (
    ELASTIC,
    HOT_MAX_PAGES,
    MP_RUN_ARGS,
    PAGE,
    SESSION_END_S,
    proc_fd_opens,
)

EngineRuns = Callable[..., dict[str, Any]]
ARGS = MP_RUN_ARGS  # the ledger and validation-table tests reuse these runs


def test_mp_outputs_identical_to_native(runs: EngineRuns) -> None:
    native = runs("tiny-llama", *ARGS, mp=True)
    elastic = runs("tiny-llama", *ARGS, mp=True, **ELASTIC)
    assert elastic["elastic"] and not native["elastic"]
    assert elastic["functional"] == native["functional"]
    assert elastic["functional"][:4] == elastic["functional"][4:]
    assert len(elastic["concurrent"]) == 16
    assert all(len(t) == 64 for t in elastic["concurrent"])
    assert elastic["concurrent"] == native["concurrent"]


def test_no_engine_process_opens_another_through_proc(runs: EngineRuns) -> None:
    """The engine core never reaches into its worker's memory (``/proc/<pid>/fd``): the
    worker maps what the scheduler granted. Every Python process of the engine is audited
    (the runner's own footprint probe aside)."""
    elastic = runs("tiny-llama", *ARGS, mp=True, **ELASTIC)
    assert proc_fd_opens(elastic) == []
    probe = [line for line in elastic["proc_fd_opens"] if line["pid"] == elastic["runner_pid"]]
    assert probe, "the audit saw nothing at all: is it loaded in the engine's processes?"


def test_mp_scheduler_clock_counts_both_sides(runs: EngineRuns) -> None:
    """``ELASTICKV_SCHEDULER_CLOCK`` counts the engine core process's scheduler on a native
    engine as on an elastic one: the file the runner created is written from the engine core
    process, a step's ``schedule`` and ``update_from_output`` alike."""
    for result in (
        runs("tiny-llama", *ARGS, mp=True),
        runs("tiny-llama", *ARGS, mp=True, **ELASTIC),
    ):
        clock = result["scheduler_clock"]
        print(f"\n[vllm-mp elastic={result['elastic']}] scheduler clock {clock}")
        assert clock["schedule_calls"] >= 64, clock  # 64 tokens per request at least
        assert clock["update_calls"] >= 64, clock
        assert clock["schedule_ns"] > 0 and clock["update_ns"] > 0, clock


def test_mp_footprint_follows_load(runs: EngineRuns) -> None:
    elastic = runs("tiny-llama", *ARGS, mp=True, **ELASTIC)
    idle = elastic["idle"]["footprint_bytes"]  # the null block's pages only
    samples = [s["footprint_bytes"] for s in elastic["samples"]]
    print(f"\n[vllm-mp elastic] idle {idle} peak {max(samples)} after {elastic['after']}")
    assert 0 < idle <= 2 * PAGE
    assert max(samples) >= 4 * idle, (idle, samples)
    assert elastic["after"]["footprint_bytes"] <= idle + HOT_MAX_PAGES * PAGE


def test_mp_shutdown_leaves_no_process(runs: EngineRuns) -> None:
    for result in (
        runs("tiny-llama", *ARGS, mp=True),
        runs("tiny-llama", *ARGS, mp=True, **ELASTIC),
    ):
        shutdown = result["shutdown"]
        names = " ".join(shutdown["children"].values())
        assert "EngineCore" in names and "Worker" in names, names
        assert not shutdown["left"], shutdown
        # The runner (and its resource tracker) exited too: nothing of the tree remains.
        assert not _still_running([int(pid) for pid in shutdown["children"]])


def _still_running(pids: list[int], timeout: float = SESSION_END_S) -> list[int]:
    """Those of ``pids`` still running (not zombies) after up to ``timeout`` seconds (only
    against a hang: the resource tracker exits as soon as it sees the runner gone)."""
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)
