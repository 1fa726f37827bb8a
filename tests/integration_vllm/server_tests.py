"""The OpenAI server tests, shared by the 0.28 and 0.32 test files (which import them): the
``servers`` fixture (conftest) runs a native and an elastic server once per session;
``ELASTICKV=1`` is the only difference between them."""

from __future__ import annotations

import os
import re
from typing import Any

from plugin_harness import HOT_MAX_PAGES, PAGE, SERVER_MAX_TOKENS

__all__ = [
    "test_server_completions_identical_to_native",
    "test_server_footprint_returns_after_load",
    "test_server_health_and_elastic_pool",
    "test_server_log_says_elastickv_is_on",
    "test_server_metrics_count_commits_and_split_blocks",
    "test_server_registers_in_ledger_by_model_and_port",
    "test_server_sigterm_leaves_no_process",
]


def served_name(model: str) -> str:
    """The name an engine of ``model`` registers under: a built-in model's own name (not its
    cache directory's, ``tiny-llama-<digest>``), else the directory's."""
    from elastickv.models import builtin_name_of

    return builtin_name_of(model) or os.path.basename(model.rstrip("/"))


def test_server_health_and_elastic_pool(servers: dict[str, Any]) -> None:
    native, elastic = servers["native"], servers["elastic"]
    for run in (native, elastic):
        assert run["health"] == 200 and run["final_health"] == 200
    assert native["pool_holders"] == 0
    # Only the worker holds its pool: the engine core grants pages, the worker maps them.
    assert elastic["pool_holders"] == 1


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
    assert instance["name"] == f"{served_name(elastic['model'])}:{elastic['port']}"
    assert instance["committed_bytes"] > 0  # the null block's pages, admitted by the ledger
    metrics = elastic["metrics"]
    assert "elastickv_committed_bytes" in metrics and f'"{instance["name"]}"' in metrics
    assert elastic["ledger_after"] == []


def test_server_log_says_elastickv_is_on(servers: dict[str, Any]) -> None:
    """vLLM's own log shows elastickv's start-up line (version, contract, instance, blocks,
    page, floor, budget) in the elastic server and nothing of elastickv in the native one."""
    elastic, native = servers["elastic"], servers["native"]
    name = f"{served_name(elastic['model'])}:{elastic['port']}"
    line = re.search(
        r"elastickv \S+ on vLLM \S+ \(0\.\d+ contract\): instance '(?P<name>[^']+)' in ledger "
        r".*; (?P<blocks>\d+) KV blocks in a virtual .*, pages of (?P<page>\S+ \S+) committed on "
        r"demand \(floor (?P<floor>\S+ \S+)\), budget none",
        elastic["log"],
    )
    assert line is not None, elastic["log"][-3000:]
    assert line["name"] == name and line["page"] == "32.0 KiB" and int(line["blocks"]) > 1
    assert re.search(r"elastickv \S+ on vLLM", native["log"]) is None


def test_server_metrics_count_commits_and_split_blocks(servers: dict[str, Any]) -> None:
    """Under vLLM, every page commit lands in ``elastickv_commit_seconds``, and blocks are
    reported as in use / cached for prefix reuse / backed (their sum)."""
    after = servers["elastic"]["metrics_after"]

    def value(name: str) -> float:
        found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", after, re.MULTILINE)
        assert found is not None, name
        return float(found.group(1))

    assert value("elastickv_commit_seconds_count") > 0
    assert value("elastickv_pages_committed_total") > 0
    # Scraped once every request finished: nothing is in use, whatever stays backed is the
    # prefix cache (the old gauge counted those blocks as "live" on an idle server).
    assert value("elastickv_in_use_blocks") == 0
    assert value("elastickv_backed_blocks") == value("elastickv_cached_blocks")
