"""A worker that cannot map the pages its scheduler granted stops the engine with a clear
error: it never runs a step on unmapped blocks, and no rank waits forever for another.

Host memory runs out at the system-call layer: a small shim (``failalloc/failalloc.c``,
loaded with ``LD_PRELOAD``) makes ``fallocate`` fail with ENOMEM after the null block's pages,
so the first step's pages cannot be mapped. One worker (the multiprocess executor), and two
tensor-parallel ranks that both fail (rank 0 reports it to the engine core, rank 1 exits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from plugin_harness import (
    ELASTIC,
    TP_ARGS,
    TP_BIND,
    failalloc_library,
    ledger_list,
    start_engine,
)

from elastickv.models import ensure_tiny_model

# Concurrent requests: more blocks than the null block's pages hold (the functional prompts,
# one at a time, fit there).
ARGS = ["concurrent", "--max-tokens", "16", "--no-prefix-caching"]


def run_failing(cache_root: Path, args: list[str], extra: dict[str, str]) -> dict[str, Any]:
    env = {
        **ELASTIC,
        **extra,
        "LD_PRELOAD": str(failalloc_library()),
        # Each worker's null block (a page in each of tiny-llama's 2 layers), then nothing.
        "FAIL_FALLOCATE_AFTER": "2",
    }
    engine = start_engine(
        cache_root, str(ensure_tiny_model("tiny-llama")), args, env, multiprocess=True
    )
    try:
        stdout, stderr = engine.proc.communicate(timeout=300)
    finally:
        if engine.proc.poll() is None:
            engine.proc.kill()
            engine.proc.wait()
    engine.audit.unlink(missing_ok=True)
    # vLLM's own log goes to stdout, Python's tracebacks to stderr.
    return {"returncode": engine.proc.returncode, "log": stdout + stderr}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_worker_that_cannot_map_stops_the_engine(cache_root: Path, tp: int) -> None:
    args = [*ARGS, *(TP_ARGS if tp > 1 else ())]
    got = run_failing(cache_root, args, TP_BIND if tp > 1 else {})
    log = got["log"]
    assert got["returncode"] != 0, log[-3000:]
    assert "cannot map the KV pages the scheduler granted" in log, log[-3000:]
    assert "Cannot allocate memory" in log, log[-3000:]
    assert ledger_list(cache_root / "ledger")["instances"] == []
