"""``elastickv serve`` with a P/D model: one served name, a prefill and a decode engine (real
vLLM 0.32, both ``ELASTICKV=1``, vLLM's NixlConnector over UCX loopback), the router's
two-step exchange; then PyPI's ``vllm-router --vllm-pd-disaggregation`` in front of the same
two engines as an interoperability check.

The reference is one engine: the prefill engine itself, asked directly without transfer
parameters (it computes the prompt and generates). Not the decode engine: its prefix cache
would then hold the prompts, and the P/D requests would read little over NIXL. The engines
run float32 (greedy ids that do not depend on how requests are batched; vLLM would pick
bfloat16 for the tiny model on the CPU, and a bfloat16 decode worker with NIXL's layout died of
SIGILL at its first read here), on one core each.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_harness import SESSION_END_S, hermetic_env
from serve_harness import (
    Reply,
    chat,
    complete,
    get_json,
    post,
    post_all,
    rpc_dir,
    serve_process,
    session_processes,
    wait_until,
)

from elastickv.control import open_ledger
from elastickv.ports import free_port

pytestmark = pytest.mark.vllm

NAME = "pd"
ENGINE_ARGS = ["--enforce-eager", "--max-model-len", "512", "--block-size", "32", "--seed", "0"]
ENGINE_ARGS += ["--dtype", "float32"]
PAGE = 32 << 10
MIN_KV = 1 << 20
BUDGET = 4 << 20
MAX_TOKENS = 16
ROLES = ("prefill", "decode")


def prompts(n: int) -> list[str]:
    """Prompts of three to six 32-token blocks (the tiny tokenizer: about 3.7 tokens a word)."""
    words = ["alpha", "beta", "gamma", "delta", "sky", "river", "stone", "light", "seven"]
    return [
        f"Prompt {i}: " + " ".join(words[(i * 5 + k * 7) % 9] for k in range(26 + 3 * i))
        for i in range(n)
    ]


PROMPTS = prompts(8)


def requests() -> list[tuple[str, dict[str, Any]]]:
    return [("/v1/completions", complete(NAME, p, MAX_TOKENS)) for p in PROMPTS]


def serve_config(path: Path, port: int, log_dir: Path) -> Path:
    path.write_text(
        f'log_dir = "{log_dir}"\npython = "{sys.executable}"\n'
        f"[router]\nport = {port}\n"
        f"[device]\nbudget = {BUDGET}\npage_size = {PAGE}\nhot_max_pages = 2\n\n"
        f'[[model]]\nname = "{NAME}"\nmodel = "tiny-llama"\nargs = {json.dumps(ENGINE_ARGS)}\n'
        f'min_kv = {MIN_KV}\npinned = true\nrelease_after = "never"\nstop_after = "never"\n'
        'pd = { prefill_env = { VLLM_CPU_OMP_THREADS_BIND = "0" }, '
        'decode_env = { VLLM_CPU_OMP_THREADS_BIND = "1" } }\n'
    )
    return path


def describe(base: str) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in get_json(base, "/health")["models"]}


def urlread(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


def metric_sum(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def ids(replies: list[Reply]) -> list[Any]:
    return [(r.status, r.token_ids) for r in replies]


def ledger_used(ledger_dir: Path) -> dict[str, int]:
    if not (ledger_dir / "host.ledger").exists():
        return {}
    with open_ledger("host", directory=str(ledger_dir), create=False) as ledger:
        return {i.name: i.used_bytes for i in ledger.list_instances()}


@contextlib.contextmanager
def vllm_router(prefill: str, decode: str, log: Path, env: dict[str, str]) -> Iterator[str]:
    """vLLM's own router in P/D mode in front of the two engines; its base URL when ready."""
    port = free_port()
    binary = str(Path(sys.executable).with_name("vllm-router"))
    cmd = [binary, "--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    cmd += ["--prefill", prefill, "--decode", decode, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"vllm-router exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                urlread(base + "/health")
                return True
            return False

        assert wait_until(ready, 60, 0.2) is not None, log.read_text()[-3000:]
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def serve_pd(cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("serve-pd")
    ledger_dir = work / "ledger"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = serve_config(work / "serve.toml", port, work / "engine-logs")
    env = hermetic_env(
        cache_root,
        {"ELASTICKV_LEDGER_DIR": str(ledger_dir), "ELASTICKV_CHECK_COMMITS": "1"},
        multiprocess=True,
    )
    r: dict[str, Any] = {}
    started = time.monotonic()
    with serve_process(config, env, work / "serve.log", port) as proc:
        r["startup_s"] = round(time.monotonic() - started, 1)
        r["models"] = get_json(base, "/v1/models")["data"]
        r["describe"] = describe(base)
        engines = {role: r["describe"][f"{NAME}/{role}"] for role in ROLES}
        urls = {role: f"http://127.0.0.1:{engines[role]['port']}" for role in ROLES}
        # One engine: the prefill engine computing and generating by itself.
        r["reference"] = ids(post_all(urls["prefill"], requests()))
        r["reference_chat"] = post(
            urls["prefill"], "/v1/chat/completions", chat(NAME, PROMPTS[0], MAX_TOKENS)
        )
        before = urlread(urls["decode"] + "/metrics")
        # Through elastickv serve's router: the two-step exchange.
        r["served"] = ids(post_all(base, requests()))
        r["served_stream"] = post(
            base, "/v1/completions", complete(NAME, PROMPTS[1], MAX_TOKENS, stream=True)
        )
        r["served_chat"] = post(base, "/v1/chat/completions", chat(NAME, PROMPTS[0], MAX_TOKENS))
        after = urlread(urls["decode"] + "/metrics")
        r["moved_bytes"] = metric_sum(after, "vllm:nixl_bytes_transferred_sum") - metric_sum(
            before, "vllm:nixl_bytes_transferred_sum"
        )
        r["prefill_metrics"] = urlread(urls["prefill"] + "/metrics")
        r["router_metrics"] = urlread(base + "/metrics")
        r["ledger"] = ledger_used(ledger_dir)
        # vLLM's own P/D router in front of the same two engines.
        with vllm_router(urls["prefill"], urls["decode"], work / "vllm-router.log", env) as vr:
            r["vllm_router"] = ids(post_all(vr, requests()))
        r["engine_pids"] = [engines[role]["engine_pid"] for role in ROLES]
        r["rpc_dirs"] = [rpc_dir(pid)["path"] for pid in r["engine_pids"]]
        r["describe_end"] = describe(base)
        proc.terminate()
        r["serve_exit"] = proc.wait(timeout=120)
    # serve's stop ends with a SIGKILL to whatever of an engine did not stop in time: those
    # processes (and the ledger records they hold) may still be exiting when serve has. Only
    # against a hang: SESSION_END_S.
    wait_until(lambda: not any(session_processes(pid) for pid in r["engine_pids"]), SESSION_END_S)
    r["left"] = [pid for pid in r["engine_pids"] if session_processes(pid)]
    r["rpc_dirs_left"] = [path for path in r["rpc_dirs"] if path.exists()]
    r["ledger_after"] = ledger_used(ledger_dir)
    r["logs"] = {p.stem: p.read_text(errors="replace") for p in (work / "engine-logs").iterdir()}
    print("\n[serve pd]", {k: v for k, v in r.items() if k.endswith("_s") or k == "moved_bytes"})
    return r


def test_served_as_one_model_on_two_engines(serve_pd: dict[str, Any]) -> None:
    (listed,) = serve_pd["models"]
    assert listed["id"] == NAME and listed["engines"] == {"prefill": "idle", "decode": "idle"}
    for role in ROLES:
        engine = serve_pd["describe"][f"{NAME}/{role}"]
        assert (engine["role"], engine["served_name"]) == (role, NAME)
    # Each engine is its own ledger instance, holding committed pages.
    assert set(serve_pd["ledger"]) == {f"{NAME}/prefill", f"{NAME}/decode"}
    assert all(used > 0 for used in serve_pd["ledger"].values())


def test_pd_output_equals_one_engine(serve_pd: dict[str, Any]) -> None:
    reference = serve_pd["reference"]
    assert all(status == 200 and len(t) == MAX_TOKENS for status, t in reference), reference
    assert serve_pd["served"] == reference
    stream = serve_pd["served_stream"]
    assert stream.status == 200 and stream.error_event is None
    served_chat, reference_chat = serve_pd["served_chat"], serve_pd["reference_chat"]
    assert served_chat.status == reference_chat.status == 200
    assert served_chat.text == reference_chat.text


def test_the_kv_really_moved(serve_pd: dict[str, Any]) -> None:
    from elastickv.models import BUILTIN_MODELS

    shape = BUILTIN_MODELS["tiny-llama"]
    # K and V of every layer for 32 tokens, float32.
    block = shape.num_hidden_layers * 2 * shape.num_key_value_heads * shape.head_dim * 32 * 4
    # NIXL's own count on the decode engine: three full blocks or more per prompt crossed.
    assert serve_pd["moved_bytes"] >= 3 * len(PROMPTS) * block, (serve_pd["moved_bytes"], block)
    assert metric_sum(serve_pd["prefill_metrics"], "vllm:nixl_num_kv_expired_reqs_total") == 0
    assert f'elastickv_router_ttft_seconds_count{{model="{NAME}"}}' in serve_pd["router_metrics"]


def test_vllm_router_interoperates_with_the_same_engines(serve_pd: dict[str, Any]) -> None:
    assert serve_pd["vllm_router"] == serve_pd["reference"]


def test_nothing_left_after_serve_stops(serve_pd: dict[str, Any]) -> None:
    assert serve_pd["serve_exit"] == 0
    assert serve_pd["left"] == []
    assert serve_pd["rpc_dirs_left"] == []
    assert serve_pd["ledger_after"] == {}
    assert all(m["restarts"] == 0 for m in serve_pd["describe_end"].values())
    assert "NIXL is available" in serve_pd["logs"][f"{NAME}_decode"]
