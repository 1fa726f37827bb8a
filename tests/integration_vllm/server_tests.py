"""The OpenAI server tests, shared by the 0.28 and 0.32 test files (which import them): the
``servers`` fixture (conftest) runs a native and an elastic server once per session;
``ELASTICKV=1`` is the only difference between them."""

from __future__ import annotations

import os
from typing import Any

from plugin_harness import HOT_MAX_PAGES, PAGE, SERVER_MAX_TOKENS

__all__ = [
    "test_server_completions_identical_to_native",
    "test_server_footprint_returns_after_load",
    "test_server_health_and_elastic_pool",
    "test_server_registers_in_ledger_by_model_and_port",
    "test_server_sigterm_leaves_no_process",
]


def test_server_health_and_elastic_pool(servers: dict[str, Any]) -> None:
    native, elastic = servers["native"], servers["elastic"]
    for run in (native, elastic):
        assert run["health"] == 200 and run["final_health"] == 200
    assert native["pool_holders"] == 0
    # The worker maps the pool and the engine core opened it to commit pages.
    assert elastic["pool_holders"] == 2


def test_server_completions_identical_to_native(servers: dict[str, Any]) -> None:
    native, elastic = servers["native"], servers["elastic"]
    assert elastic["functional"] == native["functional"]
    assert elastic["functional"][:4] == elastic["functional"][4:]
    outputs = elastic["outputs"]
    assert len(outputs) == 16
    assert all(len(o["token_ids"]) == SERVER_MAX_TOKENS for o in outputs)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in native["outputs"]]
    assert [o["text"] for o in outputs] == [o["text"] for o in native["outputs"]]


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
