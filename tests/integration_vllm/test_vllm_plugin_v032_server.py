"""elastickv under vLLM 0.32's OpenAI server (``ELASTICKV=1`` is the only difference): health,
16 concurrent greedy completions identical to a native server, SIGTERM leaves no process.

The two servers run one after the other (never two vLLM process trees at once).
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from plugin_harness import (
    ELASTIC,
    HOT_MAX_PAGES,
    PAGE,
    footprint_bytes,
    free_port,
    ledger_list,
    openai_server,
    pool_fds,
    terminate,
)
from vllm_runner import concurrent_prompts

MAX_TOKENS = 24


def _serve(cache_root: Path, log: Path, extra: dict[str, str]) -> dict[str, Any]:
    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    ledger_dir = cache_root / "ledger"
    with openai_server(cache_root, model, extra, log) as server:
        result: dict[str, Any] = {"health": server.get_status("/health"), "port": server.port}
        result["ledger"] = ledger_list(ledger_dir)["instances"]
        if "ELASTICKV_METRICS_PORT" in extra:
            url = f"http://127.0.0.1:{extra['ELASTICKV_METRICS_PORT']}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                result["metrics"] = response.read().decode()
        holders = pool_fds(list(server.descendants))
        result["pool_holders"] = len(holders)
        path = next((paths[0] for paths in holders.values()), None)
        result["idle_footprint"] = None if path is None else footprint_bytes(path)
        result["outputs"] = server.complete_all(concurrent_prompts(16), MAX_TOKENS)
        result["after_footprint"] = None if path is None else footprint_bytes(path)
        result["shutdown"] = terminate(server)
    result["ledger_after"] = ledger_list(ledger_dir)["instances"]
    result["model"] = model
    return result


@pytest.fixture(scope="module")
def servers(cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    logs = tmp_path_factory.mktemp("server-logs")
    result = {
        "native": _serve(cache_root, logs / "native.log", {}),
        "elastic": _serve(
            cache_root,
            logs / "elastic.log",
            {**ELASTIC, "ELASTICKV_METRICS_PORT": str(free_port())},
        ),
    }
    for name, run in result.items():
        summary = {k: v for k, v in run.items() if k not in ("outputs", "metrics")}
        print(f"\n[vllm-server {name}] {summary}")
    return result


def test_server_health_and_elastic_pool(servers: dict[str, Any]) -> None:
    native, elastic = servers["native"], servers["elastic"]
    assert native["health"] == 200 and elastic["health"] == 200
    assert native["pool_holders"] == 0
    # The worker maps the pool and the engine core opened it to commit pages.
    assert elastic["pool_holders"] == 2


def test_server_completions_identical_to_native(servers: dict[str, Any]) -> None:
    native, elastic = servers["native"]["outputs"], servers["elastic"]["outputs"]
    assert len(elastic) == 16
    assert all(len(o["token_ids"]) == MAX_TOKENS for o in elastic)
    assert [o["token_ids"] for o in elastic] == [o["token_ids"] for o in native]
    assert [o["text"] for o in elastic] == [o["text"] for o in native]


def test_server_footprint_returns_after_load(servers: dict[str, Any]) -> None:
    elastic = servers["elastic"]
    assert elastic["after_footprint"] <= elastic["idle_footprint"] + HOT_MAX_PAGES * PAGE


def test_server_sigterm_leaves_no_process(servers: dict[str, Any]) -> None:
    for name in ("native", "elastic"):
        shutdown = servers[name]["shutdown"]
        assert not shutdown["left"], (name, shutdown)


def test_server_registers_in_ledger_by_model_and_port(servers: dict[str, Any]) -> None:
    """`elastickv list` shows the running engine as `<served model name>:<port>`, with its
    metrics on ELASTICKV_METRICS_PORT; after SIGTERM no record is left."""
    elastic, native = servers["elastic"], servers["native"]
    assert native["ledger"] == []
    (instance,) = elastic["ledger"]
    assert instance["name"] == f"{os.path.basename(elastic['model'])}:{elastic['port']}"
    assert instance["committed_bytes"] > 0  # the null block's pages, admitted by the ledger
    metrics = elastic["metrics"]
    assert "elastickv_committed_bytes" in metrics and f'"{instance["name"]}"' in metrics
    assert elastic["ledger_after"] == []
