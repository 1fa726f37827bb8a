"""P/D across tensor-parallel sizes on elastic storage, real vLLM 0.32 and real NIXL: a
TP=1 and a TP=2 OpenAI server, both ``ELASTICKV=1`` under a budget, each prefilling for the
other. TP=1 -> TP=2: each decode rank reads its head slice of the prefiller's blocks; TP=2 ->
TP=1: the decoder fills each block from both prefill ranks. The geometry of those slices is
checked number for number in ``tests/vllm/test_transfer_v032.py``; here the tokens are.

The reference is one engine: the TP=1 server alone. Float32: greedy ids that do not depend
on the batch, nor (as measured in the TP tests) on TP=1 against TP=2.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pd_harness import (
    ENGINE,
    MAX_TOKENS,
    engine_env,
    exchange,
    idle_cpu_s,
    parallel,
    post,
    prompts,
    token_ids,
)
from plugin_harness import TP, TP_BIND, ledger_list, openai_server, terminate

from elastickv.ports import free_port

PROMPTS = prompts(8, "Across")
IDLE_S = 2.0


def moved_bytes(server: Any) -> float:
    """NIXL's own count of the bytes this engine has read (its ``/metrics``)."""
    with urllib.request.urlopen(server.url("/metrics"), timeout=30) as response:
        text = response.read().decode()
    pattern = r"^vllm:nixl_bytes_transferred_sum(?:{[^}]*})? ([0-9.eE+-]+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def completions(server: Any) -> list[list[int] | None]:
    return [
        token_ids(r)
        for r in parallel(lambda p: post(server, {"prompt": p, "max_tokens": MAX_TOKENS}), PROMPTS)
    ]


@pytest.fixture(scope="module")
def pd_tp(cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    logs = tmp_path_factory.mktemp("pd-tp-logs")
    one_env = engine_env(free_port(), 0)
    two_env = {**engine_env(free_port(), 0), **TP_BIND}
    two_args: dict[str, str | None] = {**ENGINE, "tensor-parallel-size": str(TP)}
    r: dict[str, Any] = {}
    with (
        openai_server(cache_root, model, one_env, logs / "tp1.log", ENGINE) as one,
        openai_server(cache_root, model, two_env, logs / "tp2.log", two_args) as two,
    ):
        r["reference"] = completions(one)
        r["tp2_alone"] = completions(two)
        r["one_to_two"] = [
            token_ids(p[1]) for p in parallel(lambda x: exchange(one, two, x), PROMPTS)
        ]
        r["read_by_tp2"] = moved_bytes(two)
        r["two_to_one"] = [
            token_ids(p[1]) for p in parallel(lambda x: exchange(two, one, x), PROMPTS)
        ]
        r["read_by_tp1"] = moved_bytes(one)
        r["idle_cpu_s"] = idle_cpu_s([one, two], IDLE_S)
        r["ledger"] = ledger_list(cache_root / "ledger")["instances"]
        r["stops"] = [terminate(two), terminate(one)]
    r["ledger_after"] = ledger_list(cache_root / "ledger")["instances"]
    print("\n[pd tp]", {k: v for k, v in r.items() if k.startswith(("read_by", "idle"))})
    return r


def test_prefill_tp1_to_decode_tp2_equals_one_engine(pd_tp: dict[str, Any]) -> None:
    reference = pd_tp["reference"]
    assert all(ids is not None and len(ids) == MAX_TOKENS for ids in reference), reference
    assert pd_tp["tp2_alone"] == reference
    assert pd_tp["one_to_two"] == reference
    assert pd_tp["read_by_tp2"] > 0  # the KV crossed: NIXL's own count on the reader


def test_prefill_tp2_to_decode_tp1_equals_one_engine(pd_tp: dict[str, Any]) -> None:
    assert pd_tp["two_to_one"] == pd_tp["reference"]
    assert pd_tp["read_by_tp1"] > 0


def test_both_engines_registered_and_nothing_left(pd_tp: dict[str, Any]) -> None:
    assert len(pd_tp["ledger"]) == 2, pd_tp["ledger"]
    assert all(stop["left"] == {} for stop in pd_tp["stops"]), pd_tp["stops"]
    assert pd_tp["ledger_after"] == []


def test_idle_engines_nixl_threads_sleep(pd_tp: dict[str, Any]) -> None:
    """On vLLM's CPU backend the three workers' NIXL progress threads wait for events by
    default (``ELASTICKV_NIXL_PROGRESS_WAIT_MS`` unset) and sleep while nothing is in flight:
    spinning, they would take three cores' worth of CPU (about ``3 * IDLE_S`` seconds, or all
    of a two-core host's ``2 * IDLE_S``)."""
    assert pd_tp["idle_cpu_s"] < IDLE_S / 2, pd_tp["idle_cpu_s"]
