"""``elastickv cluster`` end to end: real Ray Serve (PyPI's Ray 2.60), a two-node Ray cluster of
this machine (``ray.cluster_utils``), real vLLM 0.32 engines, real HTTP. One run goes through
every scenario of the acceptance list in order; each test asserts one part of what it
recorded.

The cluster: a head node and one added node, each with one ``elastickv_device`` (one device
replica each, placed by Ray's resources) and a ledger directory of its own (as separate hosts
have); the ingress on the head (``elastickv_ingress``), Ray Serve's proxy there only. One pool
of two replicas, two models each at most, three tiny models. The command runs as a user runs
it: ``elastickv cluster --config`` against the cluster's address, the API key in a file.

1. Without the key, or with a wrong one: 401 on every model route of the ingress, of a
   replica called directly through Ray, and of a replica's serve router.
2. Completions (fp32, each request alone) equal native vLLM's; chat and streams answer. The
   router places ``a`` on the head's replica (ties go to the ingress's node), ``b`` on the
   other, ``c`` on the head's; every request of a model lands on its replica (the answers'
   headers, and Ray's Prometheus export counted per replica).
3. Mid-load, by construction: ``b``'s engine is stopped (SIGSTOP) and three requests for it
   are in flight at its serve; then the node is removed. They fail with 502
   ``replica_failed``; nothing of the node is left (replica, serve, engine, ledger record);
   ``b`` is served again from the head's replica, which is full: it stops its least recently
   used model (``a``) and loads ``b``, with native outputs again. The failover time (node
   removed to ``b``'s first answer) is measured and bounded.
4. A node added again: Ray Serve starts the missing replica there.
5. A short bursty run (bench_serve's correlated burst, streamed, token-id prompts) through
   the ingress: no failure.
6. Ctrl-C: the application is removed; nothing of the run is left; the key is in no log,
   no file Ray, serve or the engines wrote, no metric, no engine's environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from cluster_harness import (
    Command,
    RayCluster,
    Reply,
    engine_servers,
    files_holding,
    mine,
    request,
    requests_by_replica,
    scrape,
    serves,
    wait_until,
)
from plugin_harness import hermetic_env

from elastickv.bench.client import run_schedule
from elastickv.bench.workloads import TOKEN_RANGE, Shape, correlated_burst
from elastickv.control import open_ledger
from elastickv.models import ensure_tiny_model
from elastickv.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

TOKEN_NAME = "EKV_TEST_CLUSTER_TOKEN"
TOKEN = secrets.token_hex(8)
MODELS = {  # served name -> (built-in model, extra vLLM arguments); all run in fp32
    "a": ("tiny-llama", []),
    "b": ("tiny-llama-deep", []),
    "c": ("tiny-llama-bf16", ["--dtype", "float32"]),
}
ENGINE_ARGS = ["--enforce-eager", "--max-model-len", "256", "--block-size", "32", "--seed", "0"]
MAX_TOKENS = 16
_RNG = random.Random(31)
PROMPTS = [[_RNG.randrange(*TOKEN_RANGE) for _ in range(n)] for n in (8, 21, 40)]
IN_FLIGHT = 3  # requests for b held at its stopped engine when its node is removed
FAILOVER_BOUND_S = 240.0  # node removed -> b answered by the other replica (one engine start)
CALL = Path(__file__).with_name("cluster_call.py")
NATIVE = Path(__file__).with_name("cluster_native.py")


def completion(model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }  # fmt: skip


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model, "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra,
    }  # fmt: skip


def token_ids(reply: Reply) -> list[int] | None:
    if reply.status != 200 or not isinstance(reply.body, dict):
        return None
    ids: list[int] = reply.body["choices"][0]["token_ids"]
    return ids


def text_of(reply: Reply) -> str:
    if reply.body is None:
        return reply.text
    choice = reply.body["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def native_answers(cache_root: Path, paths: dict[str, str]) -> dict[str, list[list[int]]]:
    spec = {
        "models": {name: {"path": paths[name], "dtype": "float32"} for name in MODELS},
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "engine": {
            "enforce_eager": True, "max_model_len": 256, "block_size": 32, "seed": 0,
            "kv_cache_memory_bytes": 32 << 20,
        },
    }  # fmt: skip
    env = hermetic_env(cache_root, {}, multiprocess=False)
    done = subprocess.run(
        [sys.executable, str(NATIVE), json.dumps(spec)], env=env, capture_output=True,
        text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    answers: dict[str, list[list[int]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


def config_text(address: str, port: int, key_file: Path, logs: Path) -> str:
    models = "".join(
        f'[[model]]\nname = "{name}"\nmodel = "{source}"\n'
        f"args = {json.dumps(ENGINE_ARGS + extra)}\n"
        'min_kv = "8M"\nrelease_after = "never"\n'
        for name, (source, extra) in MODELS.items()
    )
    return (
        f'[ray]\naddress = "{address}"\n'
        f'[ingress]\nport = {port}\napi_key_file = "{key_file}"\nproxy_location = "HeadOnly"\n'
        "resources = { elastickv_ingress = 1 }\n"
        '[[pool]]\nname = "device"\nreplicas = 2\nresources = { elastickv_device = 1 }\n'
        f'max_models = 2\nbudget = "48M"\npage_size = "64K"\nlog_dir = "{logs}"\n' + models
    )


def node(ledger: Path, **extra: Any) -> dict[str, Any]:
    """A node's arguments: one device, its own ledger directory (as a separate host has)."""
    return {
        "num_cpus": 1,
        "resources": {"elastickv_device": 1, **extra.pop("resources", {})},
        "env_vars": {"ELASTICKV_LEDGER_DIR": str(ledger)},
        **extra,
    }


def ledger_names(directory: Path) -> list[str]:
    if not (directory / "host.ledger").exists():
        return []
    with open_ledger("host", directory=str(directory), create=False) as ledger:
        return sorted(i.name for i in ledger.list_instances())


def serve_health(port: int, key: str) -> dict[str, Any]:
    reply = request(f"http://127.0.0.1:{port}", "GET", "/health", key=key, timeout=30)
    assert reply.status == 200, reply
    document: dict[str, Any] = reply.body
    return document


def held(port: int, key: str) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in serve_health(port, key)["models"]}


def alive(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def in_background(call: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


@pytest.fixture(scope="module")
def run(cache_root: Path) -> Iterator[dict[str, Any]]:
    """The whole scenario (see the module doc), recorded; everything of it stopped after."""
    paths = {name: str(ensure_tiny_model(source)) for name, (source, _) in MODELS.items()}
    began = time.monotonic()
    result: dict[str, Any] = {"native": native_answers(cache_root, paths)}
    result["native_s"] = round(time.monotonic() - began, 1)
    tmp = Path(tempfile.mkdtemp(prefix="ekv-cl-"))  # short: Ray's socket paths live under it
    key = secrets.token_urlsafe(32)
    key_file = tmp / "api-key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    ledgers = {"head": tmp / "ledger-head", "worker": tmp / "ledger-worker"}
    env = hermetic_env(cache_root, {}, multiprocess=True)
    env = {k: v for k, v in env.items() if not k.startswith("ELASTICKV")}
    env.update({
        TOKEN_NAME: TOKEN,
        "RAY_TMPDIR": str(tmp),
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray starts its workers at nice 15 and the engines would inherit it: compete with
        # the rest of the suite on equal terms.
        "RAY_worker_niceness": "0",
    })  # fmt: skip
    spec = {
        "head": node(
            ledgers["head"], resources={"elastickv_ingress": 1},
            _system_config={"metrics_report_interval_ms": 1000},
        ),
        "workers": [node(ledgers["worker"])],
    }  # fmt: skip
    cluster: RayCluster | None = None
    command: Command | None = None
    try:
        cluster = RayCluster(spec, env, tmp / "ray-cluster.log")
        nodes = {("head" if n["head"] else "worker"): n for n in cluster.description["nodes"]}
        result["nodes"] = nodes
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        config = tmp / "cluster.toml"
        config.write_text(config_text(cluster.description["address"], port, key_file, tmp / "logs"))
        command = Command(
            [sys.executable, "-m", "elastickv.cli.main", "cluster", "--config", str(config)], env
        )
        command.wait_for(r"serving a, b, c at http://", timeout=600)
        result["deployed_s"] = round(time.monotonic() - began, 1)

        # 1. The key, at the ingress: every model route, no key and a wrong one.
        routes = [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", completion("a", PROMPTS[0])),
            ("POST", "/v1/chat/completions", chat("a")),
        ]
        result["ingress_refused"] = [
            (method, path, given is None, request(base, method, path, body, key=given))
            for given in (None, key[:-1] + ("x" if key[-1] != "x" else "y"))
            for method, path, body in routes
        ]
        result["models"] = request(base, "GET", "/v1/models", key=key)

        # 2. Each model alone: completions (compared with native), a stream, chat and a
        # streamed chat. a, b, c in turn: on the head's replica c is used last.
        answers: dict[str, list[Reply]] = {}
        loads: dict[str, float] = {}
        for name in MODELS:
            started = time.monotonic()
            answers[name] = [request(base, "POST", "/v1/completions", completion(name, p), key=key)
                             for p in PROMPTS]  # fmt: skip
            loads[name] = round(time.monotonic() - started, 1)
            answers[name] += [
                request(base, "POST", "/v1/completions",
                        completion(name, PROMPTS[1], stream=True), key=key),
                request(base, "POST", "/v1/chat/completions", chat(name), key=key),
                request(base, "POST", "/v1/chat/completions", chat(name, stream=True), key=key),
            ]  # fmt: skip
        result["answers"], result["loads_s"] = answers, loads

        # The replicas' serve processes, and each node's engines.
        processes = mine(TOKEN_NAME, TOKEN)
        result["serves"] = serves(processes)
        result["engines"] = engine_servers(processes)
        result["held"] = {
            where: sorted(held(s["port"], key)) for where, s in result["serves"].items()
        }
        result["engine_environ_has_key"] = [
            pid for pid in result["engines"].values()
            if key in "\0".join(psutil.Process(pid).environ().values())
        ]  # fmt: skip

        # 1. (cont.) The key at a replica called directly through Ray, and at serve's router.
        call_env = {**env, "RAY_ADDRESS": cluster.description["address"]}
        spec_call = {
            "app": "elastickv", "pool": "device", "model": "b", "path": "/v1/completions",
            "body": completion("b", PROMPTS[0]),
            "authorizations": [None, "Bearer " + key[::-1], f"Bearer {key}"],
        }  # fmt: skip
        called = subprocess.run(
            [sys.executable, str(CALL), json.dumps(spec_call)], env=call_env,
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert called.returncode == 0, called.stderr[-4000:]
        result["replica_direct"] = json.loads(called.stdout.strip().splitlines()[-1])
        worker_serve = result["serves"][str(ledgers["worker"])]
        serve_base = f"http://127.0.0.1:{worker_serve['port']}"
        serve_routes = [
            *routes,
            ("GET", "/health", None),
            ("POST", "/admin/models", {"name": "z", "model": "tiny-llama"}),
            ("DELETE", "/admin/models/b", None),
        ]
        result["serve_refused"] = [
            (method, path, request(serve_base, method, path, body, key=given).status)
            for given in (None, "wrong-" + key)
            for method, path, body in serve_routes
        ]

        # Ray's Prometheus export: the requests each replica answered, by model.
        expected = requests_by_header(answers, result["replica_direct"])
        ports = [n["metrics_export_port"] for n in nodes.values()]
        texts: list[str] = []

        def counted() -> bool:
            texts[:] = [scrape(p) for p in ports]
            return dict(requests_by_replica(texts)) == expected

        counted_s = wait_until(counted, timeout=120, interval=1.0)
        result["metrics_wait_s"] = None if counted_s is None else round(counted_s, 1)
        result["metrics_expected"] = expected
        result["metrics_counted"] = dict(requests_by_replica(texts))
        result["metrics_texts"] = list(texts)

        # 3. Mid-load: b's engine stopped, IN_FLIGHT requests held there, then the node goes.
        worker_ledger = str(ledgers["worker"])
        b_engine = result["engines"][(worker_ledger, "b")]
        node_side = {worker_serve["replica_pid"], worker_serve["pid"]}
        node_side |= {p.pid for p in psutil.Process(b_engine).children(recursive=True)}
        node_side.add(b_engine)
        os.kill(b_engine, signal.SIGSTOP)
        held_calls = [
            in_background(lambda: request(base, "POST", "/v1/completions",
                                          completion("b", PROMPTS[0]), key=key)),
            in_background(lambda: request(base, "POST", "/v1/completions",
                                          completion("b", PROMPTS[1]), key=key)),
            in_background(lambda: request(base, "POST", "/v1/completions",
                                          completion("b", PROMPTS[2], stream=True), key=key)),
        ]  # fmt: skip
        in_flight = wait_until(
            lambda: held(worker_serve["port"], key)["b"]["in_flight"] == IN_FLIGHT, timeout=120
        )
        assert in_flight is not None, "the requests for b never reached its serve"
        removed_at = time.monotonic()
        result["removed"] = cluster.command(f"remove {nodes['worker']['node_id']}")
        for thread, _ in held_calls:
            thread.join(timeout=300)
        result["held_replies"] = [out[0] if out else None for _, out in held_calls]
        gone_s = wait_until(lambda: not [p for p in node_side if alive(p)], timeout=120)
        result["node_side_gone_s"] = None if gone_s is None else round(gone_s, 2)
        result["node_side_left"] = [p for p in node_side if alive(p)]
        result["worker_ledger_left"] = ledger_names(ledgers["worker"])
        # b again, through the ingress, until it answers from the other replica.
        failures: list[int] = []
        while True:
            reply = request(base, "POST", "/v1/completions", completion("b", PROMPTS[0]), key=key)
            if reply.status == 200:
                break
            failures.append(reply.status)
            assert time.monotonic() - removed_at < 2 * FAILOVER_BOUND_S, failures
            time.sleep(0.5)
        result["failover_s"] = round(time.monotonic() - removed_at, 1)
        result["failover_failures"] = failures
        result["failover_answers"] = [reply] + [
            request(base, "POST", "/v1/completions", completion("b", p), key=key)
            for p in PROMPTS[1:]
        ]
        head_serve = result["serves"][str(ledgers["head"])]
        result["held_after"] = sorted(held(head_serve["port"], key))
        a_engine = result["engines"][(str(ledgers["head"]), "a")]
        result["a_engine_alive"] = alive(a_engine)

        # 4. A node with a device again: Ray Serve starts the missing replica on it.
        ledgers["new"] = tmp / "ledger-new"
        added_at = time.monotonic()
        result["added"] = cluster.command("add " + json.dumps(node(ledgers["new"])))
        back: list[dict[str, Any]] = []

        def answering() -> bool:
            found = serves(mine(TOKEN_NAME, TOKEN)).get(str(ledgers["new"]))
            with contextlib.suppress(OSError, AssertionError):
                if found is not None:
                    back[:] = [serve_health(found["port"], key)]
            return bool(back)

        result["replica_back_s"] = wait_until(answering, timeout=300, interval=1.0)
        result["new_serve_health"] = back[0] if back else None
        result["replica_back_total_s"] = round(time.monotonic() - added_at, 1)

        # 5. A short bursty run through the ingress (bench_serve's shapes).
        arrivals = correlated_burst(
            ["b", "c"], peak=3, shape=Shape(prompt_tokens=32, min_output=8, max_output=16)
        )
        burst = asyncio.run(
            run_schedule(base, arrivals, timeout=600, headers={"Authorization": f"Bearer {key}"})
        )
        result["burst"] = burst
        result["metrics_texts"].append(scrape(nodes["head"]["metrics_export_port"]))

        # 6. Ctrl-C: the application is removed, every replica's serve stops its engines.
        command.proc.send_signal(signal.SIGINT)
        result["command_exit"] = command.finish(timeout=300)
        result["command_output"] = list(command.lines)
        command = None
        result["cluster_stop"] = cluster.stop()
        cluster = None
        result["left"] = []
        if wait_until(lambda: not mine(TOKEN_NAME, TOKEN), timeout=60) is None:
            result["left"] = [" ".join(p.cmdline())[:160] for p in mine(TOKEN_NAME, TOKEN)]
        result["ledgers_left"] = {k: ledger_names(v) for k, v in ledgers.items()}
        result["key_in_files"] = files_holding(tmp, key, skip={key_file})
        result["key"] = key
        result["wall_s"] = round(time.monotonic() - began, 1)
        print(
            f"\n[elastickv cluster] native {result['native_s']} s, deployed at "
            f"{result['deployed_s']} s, first loads {loads} s, failover {result['failover_s']} "
            f"s, the removed node's processes gone in {result['node_side_gone_s']} s, replica "
            f"back in {result['replica_back_total_s']} s, metrics counted in "
            f"{result['metrics_wait_s']} s, whole run {result['wall_s']} s"
        )
        yield result
    finally:
        if command is not None:
            command.proc.kill()
            command.proc.wait()
        if cluster is not None:
            cluster.proc.kill()
            cluster.proc.wait()
        left = mine(TOKEN_NAME, TOKEN)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(left, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def requests_by_header(
    answers: dict[str, list[Reply]], direct: list[dict[str, Any]]
) -> dict[tuple[str, str, str], int]:
    """(replica, model, status) -> requests, from the answers' replica headers (and the one
    direct call with the key, which the replica served and counted too)."""
    counts: dict[tuple[str, str, str], int] = {}
    for name, replies in answers.items():
        for reply in replies:
            where = (reply.headers["x-elastickv-replica"], name, str(reply.status))
            counts[where] = counts.get(where, 0) + 1
    for call in direct:
        if call["status"] == 200:
            where = (call["replica"], "b", "200")
            counts[where] = counts.get(where, 0) + 1
    return counts


# -- 1. the key ---------------------------------------------------------------------------------


def test_without_the_key_every_model_route_is_refused(run: dict[str, Any]) -> None:
    """401 in OpenAI's format at the ingress (no key, a wrong key), at a replica called
    directly through Ray, and at a replica's serve router; with the key, each answers."""
    for method, path, no_key, reply in run["ingress_refused"]:
        assert reply.status == 401, (method, path, no_key, reply)
        assert reply.body["error"]["code"] == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert {r[2] for r in run["ingress_refused"]} == {True, False}
    refused, wrong, right = run["replica_direct"]
    assert refused["status"] == wrong["status"] == 401
    assert refused["body"]["error"]["code"] == wrong["body"]["error"]["code"] == 401
    assert (
        right["status"] == 200
        and right["body"]["choices"][0]["token_ids"] == (run["native"]["b"][0])
    )
    assert [status for _, _, status in run["serve_refused"]] == [401] * len(run["serve_refused"])
    assert len(run["serve_refused"]) == 12


def test_the_key_is_in_no_log_file_metric_or_engine(run: dict[str, Any]) -> None:
    key = run["key"]
    assert run["key_in_files"] == []  # Ray's logs and session files, engine logs, ledgers
    assert all(key not in line for line in run["command_output"])
    assert all(key not in text for text in run["metrics_texts"])
    assert run["engine_environ_has_key"] == []


# -- 2. routing and answers ---------------------------------------------------------------------


def test_completions_equal_native_vllm(run: dict[str, Any]) -> None:
    for name in MODELS:
        got = [token_ids(r) for r in run["answers"][name][: len(PROMPTS)]]
        assert got == run["native"][name], name


def test_streams_and_chat_answer_through_the_ingress(run: dict[str, Any]) -> None:
    """A stream's text is the non-streamed answer's; chat answers, streamed or not, alike."""
    for name in MODELS:
        replies = run["answers"][name]
        plain, stream, chatted, chat_stream = replies[1], replies[3], replies[4], replies[5]
        assert stream.status == 200 and stream.error_event is None
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.text == text_of(plain) and len(stream.text) > 0
        assert chatted.status == chat_stream.status == 200
        assert chat_stream.text == text_of(chatted) and chat_stream.error_event is None


def test_each_model_lands_on_the_replica_that_holds_it(run: dict[str, Any]) -> None:
    nodes = run["nodes"]
    landed = {
        name: {(r.headers["x-elastickv-replica"], r.headers["x-elastickv-node"]) for r in replies}
        for name, replies in run["answers"].items()
    }
    assert all(len(where) == 1 for where in landed.values()), landed
    (a,), (b,), (c,) = landed["a"], landed["b"], landed["c"]
    assert a == c and a[1] == nodes["head"]["node_id"]  # ties go to the ingress's node
    assert b[1] == nodes["worker"]["node_id"] and b[0] != a[0]
    # What each replica's serve holds: its models' engines, nothing else.
    assert sorted(run["held"].values()) == [["a", "c"], ["b"]]
    listed = {m["id"]: m for m in run["models"].body["data"]}
    assert sorted(listed) == ["a", "b", "c"] and listed["a"]["pool"] == "device"


def test_rays_prometheus_export_counts_each_replicas_requests_by_model(
    run: dict[str, Any],
) -> None:
    assert run["metrics_wait_s"] is not None, (run["metrics_expected"], run["metrics_counted"])
    replicas = {replica for replica, _, _ in run["metrics_expected"]}
    assert len(replicas) == 2
    text = "\n".join(run["metrics_texts"])
    for metric in (
        "ray_elastickv_cluster_model_loaded",
        "ray_elastickv_cluster_kv_committed_bytes",
        "ray_elastickv_cluster_model_loads_total",
        "ray_serve_num_multiplexed_models",
    ):
        assert metric in text, metric  # fmt: skip


# -- 3. a node removed mid-load -----------------------------------------------------------------


def test_requests_in_flight_on_a_removed_node_fail_cleanly(run: dict[str, Any]) -> None:
    assert run["removed"] == {"removed": run["nodes"]["worker"]["node_id"]}
    for reply in run["held_replies"]:
        assert reply is not None and reply.status == 502, reply
        assert reply.body["error"]["type"] == "replica_failed"
        assert "retry" in reply.body["error"]["message"]


def test_nothing_of_the_removed_node_is_left(run: dict[str, Any]) -> None:
    """Its replica, its serve, the stopped engine and the engine's processes end (serve stops
    its engines when its replica dies; a stopped engine gets SIGCONT with its SIGTERM), and
    its ledger has no record."""
    assert run["node_side_gone_s"] is not None, run["node_side_left"]
    assert run["worker_ledger_left"] == []


def test_the_models_of_the_removed_node_are_served_again_within_the_bound(
    run: dict[str, Any],
) -> None:
    """b answers from the head's replica within FAILOVER_BOUND_S of the removal (Ray Serve
    notices the replica's death at once; the bound is one engine start on a loaded 2-core
    machine); the answers in between are 502/503 only; outputs are native's again."""
    assert run["failover_s"] <= FAILOVER_BOUND_S, run["failover_s"]
    assert set(run["failover_failures"]) <= {502, 503}, run["failover_failures"]
    nodes = run["nodes"]
    for reply in run["failover_answers"]:
        assert reply.headers["x-elastickv-node"] == nodes["head"]["node_id"]
    assert [token_ids(r) for r in run["failover_answers"]] == run["native"]["b"]


def test_a_full_replica_stops_its_least_recently_used_model(run: dict[str, Any]) -> None:
    """The head's replica held a and c (max_models 2; c used last): b's load stopped a."""
    assert run["held_after"] == ["b", "c"]
    assert not run["a_engine_alive"]


# -- 4. the replica back ------------------------------------------------------------------------


def test_ray_serve_starts_the_missing_replica_on_a_new_node(run: dict[str, Any]) -> None:
    assert run["replica_back_s"] is not None
    health = run["new_serve_health"]
    assert health is not None and health["models"] == [] and health["status"] == "ok"


# -- 5. a bursty run ----------------------------------------------------------------------------


def test_a_bursty_run_has_no_failure(run: dict[str, Any]) -> None:
    burst = run["burst"]
    assert len(burst) >= 10
    assert [r for r in burst if not r.ok] == []


# -- 6. the end ---------------------------------------------------------------------------------


def test_ctrl_c_removes_the_application_and_leaves_nothing(run: dict[str, Any]) -> None:
    assert run["command_exit"] == 0, run["command_output"][-40:]
    assert any("stopped: application 'elastickv' removed" in line
               for line in run["command_output"])  # fmt: skip
    assert run["cluster_stop"] == {"returncode": 0, "said": "stopped"}
    assert run["left"] == []
    assert run["ledgers_left"] == {"head": [], "worker": [], "new": []}
