"""``elastickv serve`` run whole, as a user runs it, with a stand-in for vLLM's server
(``standin/``; the real engines are in tests/integration_vllm/test_vllm_plugin_v032_serve.py):
the log names every state change the moment ``elastickv list`` shows it, and ends with how many
engines stopped and that nothing is left; nothing is left in the temporary directory, also
after a start refused for its budget."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import elastickv
from elastickv.ports import free_port

STANDIN = Path(__file__).with_name("standin")
SRC = Path(elastickv.__file__).resolve().parents[1]  # the elastickv this test imports


class Serve:
    """``elastickv serve`` in its own session; its log (stderr) read line by line."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastickv.cli.main", "serve", *args],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, *patterns: str, after: int = -1, timeout: float = 120) -> int:
        """The index of the first log line after line ``after``, logged already or to come,
        that matches any of ``patterns`` (regular expressions): lines of other models that
        came meanwhile stay for later calls."""
        while True:
            for index in range(after + 1, len(self.lines)):
                if any(re.search(pattern, self.lines[index]) for pattern in patterns):
                    return index
            try:
                new = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"{patterns} not logged:\n" + "\n".join(self.lines)) from None
            if new is None:
                raise AssertionError(f"serve ended before {patterns}:\n" + "\n".join(self.lines))
            self.lines.append(new)

    def rest(self, timeout: float = 120) -> list[str]:
        """Every line until serve exits."""
        self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=timeout)) is not None:
            self.lines.append(line)
        return self.lines


@pytest.fixture
def temp_dir() -> Iterator[Path]:
    """A short temporary directory (an engine's socket paths must fit in 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ekv-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def environment(temp_dir: Path, ledger_dir: Path) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")},
        "PYTHONPATH": os.pathsep.join([str(STANDIN), str(SRC)]),
        "TMPDIR": str(temp_dir),
        "ELASTICKV_LEDGER_DIR": str(ledger_dir),
        "STANDIN_GATE": str(temp_dir / "gate"),
    }


def config(tmp_path: Path, port: int) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    path = tmp_path / "serve.toml"
    path.write_text(
        f'python = "{sys.executable}"\n[router]\nport = {port}\n'
        '[device]\nbudget = "8M"\npage_size = "64K"\n'
        f'[[model]]\nname = "a"\nmodel = "{model}"\nmin_kv = "1M"\nrelease_after = "1s"\n'
        f'[[model]]\nname = "b"\nmodel = "{model}"\nmin_kv = "1M"\nrelease_after = "1s"\n'
        'stop_after = "2s"\n'
    )
    return path


def elastickv_list(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``elastickv list --json``: the served model and its ledger record, by name."""
    out = subprocess.run(
        [sys.executable, "-m", "elastickv.cli.main", "list", "--json"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    listing = json.loads(out)
    records = {i["name"]: i for i in listing["instances"]}
    (served,) = listing["serve"]
    return {m["name"]: {"model": m, "record": records.get(m["name"])} for m in served["models"]}


def test_the_log_follows_every_state_and_nothing_is_left(tmp_path: Path, temp_dir: Path) -> None:
    env = environment(temp_dir, tmp_path / "ledger")
    port = free_port()
    serve = Serve(["--config", str(config(tmp_path, port))], env)
    try:
        serve.wait_for("serving a, b at")
        # A request held by the engine until the gate opens: "serving" while it is in flight.
        body = json.dumps({"model": "a", "prompt": "hold"}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        replies: queue.Queue[int] = queue.Queue()
        threading.Thread(
            target=lambda: replies.put(urllib.request.urlopen(request, timeout=60).status),
            daemon=True,
        ).start()
        served = serve.wait_for("a: idle -> serving", "a: kv-released -> serving")
        listed = elastickv_list(env)["a"]  # what the log has said is listed already
        assert listed["model"]["state"] == "serving" and listed["model"]["in_flight"] == 1
        (temp_dir / "gate").touch()
        assert replies.get(timeout=60) == 200
        idle = serve.wait_for("a: serving -> idle", after=served)  # was never logged
        serve.wait_for("a: idle -> kv-released", after=idle)
        listed = elastickv_list(env)["a"]
        model, record = listed["model"], listed["record"]
        assert model["state"] == "kv-released" and record is not None
        # One reading: the served table's bytes are the ledger record's, and it drains.
        assert model["committed_bytes"] == record["used_bytes"] == 3 * (64 << 10)
        assert model["limit_bytes"] == record["limit_desired"] == 64 << 10
        assert model["over_limit_bytes"] == record["over_limit_bytes"] == 2 * (64 << 10)
        serve.wait_for("b: (idle|kv-released) -> stopped")
        serve.wait_for(r"b: engine pid \d+ stopped$")
        assert elastickv_list(env)["b"]["record"] is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(serve.proc.pid, signal.SIGTERM)
    lines = serve.rest()
    assert serve.proc.returncode == 0, "\n".join(lines)
    assert any("a: engine pid" in line and line.endswith("stopped") for line in lines)
    assert lines[-1].endswith("elastickv serve: stopped: 1 engine, nothing left"), lines[-1]
    # The engine logs (temporary, nothing failed), the engines' private directories and
    # the rendezvous file each engine start left: all gone.
    assert sorted(p.name for p in temp_dir.iterdir()) == ["gate"]


def eventually(read: Any, timeout: float = 60) -> Any:
    """The first value of ``read()`` that is not None (the timeout is only against a hang)."""
    deadline = time.monotonic() + timeout
    while (value := read()) is None:
        assert time.monotonic() < deadline, "no value came"
        time.sleep(0.05)
    return value


def metric(port: int, line_prefix: str) -> float:
    """One sample of serve's ``/metrics`` (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    found = [line for line in text.splitlines() if line.startswith(line_prefix + " ")]
    return float(found[0].split()[-1]) if found else 0.0


def test_idle_models_sleep_and_wake_on_a_request(tmp_path: Path, temp_dir: Path) -> None:
    """Tiers in order: kv-released, then asleep once the engine answers the request in its
    ledger record; a request wakes it (answered, the wake timed), and it sleeps again. An
    engine that refuses stays kv-released and is not asked again."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    tiers = 'release_after = "1s"\nsleep_after = "2s"\nstop_after = "never"\n'
    path = tmp_path / "serve.toml"
    path.write_text(
        f'python = "{sys.executable}"\n[router]\nport = {(port := free_port())}\n'
        '[device]\nbudget = "8M"\npage_size = "64K"\n'
        f'[[model]]\nname = "a"\nmodel = "{model}"\nmin_kv = "1M"\n{tiers}'
        f'[[model]]\nname = "b"\nmodel = "{model}"\nmin_kv = "1M"\n{tiers}'
        'env = { STANDIN_NO_SLEEP = "1" }\n'
    )
    env = environment(temp_dir, tmp_path / "ledger")
    serve = Serve(["--config", str(path)], env)
    try:
        serve.wait_for("serving a, b at")
        asleep = serve.wait_for("a: kv-released -> asleep")
        listed = elastickv_list(env)
        assert listed["a"]["model"]["state"] == "asleep"
        assert listed["a"]["record"]["asleep"] and listed["a"]["record"]["sleep_wanted"]
        # The engine's memory, read every few seconds: there by the next reading.
        resident = eventually(lambda: elastickv_list(env)["a"]["model"]["resident_bytes"])
        assert resident > 4 << 20  # a Python interpreter, at least
        serve.wait_for("b: cannot sleep: its engine cannot release its weights")
        listed = elastickv_list(env)
        assert listed["b"]["model"]["state"] == "kv-released"
        assert listed["b"]["model"]["sleep_refused"].startswith("its engine cannot")
        assert not listed["b"]["record"]["sleep_wanted"]  # withdrawn: not asked again
        assert not listed["b"]["record"]["sleep_refused"]
        status, _ = call(port, "POST", "/v1/completions", {"model": "a", "prompt": "hi"})
        assert status == 200
        woke = serve.wait_for("a: asleep -> serving", after=asleep)
        weights = 'elastickv_router_wake_seconds_count{model="a",tier="weights"}'
        assert eventually(lambda: metric(port, weights) or None) == 1.0  # timed within 20 ms
        serve.wait_for("a: kv-released -> asleep", after=woke)  # and asleep again
        assert not any("b: kv-released -> asleep" in line for line in serve.lines)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(serve.proc.pid, signal.SIGTERM)
    lines = serve.rest()
    assert serve.proc.returncode == 0, "\n".join(lines)
    assert lines[-1].endswith("elastickv serve: stopped: 2 engines, nothing left"), lines[-1]


def test_a_refused_start_leaves_no_log_folder(tmp_path: Path, temp_dir: Path) -> None:
    env = environment(temp_dir, tmp_path / "ledger")
    proc = subprocess.run(
        [sys.executable, "-m", "elastickv.cli.main", "serve", "--config",
         str(config(tmp_path, free_port())), "--budget", "100T"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "[device] budget = 100.0 TiB is more than" in proc.stderr
    assert list(temp_dir.iterdir()) == []


def test_an_engine_that_cannot_start_keeps_its_log(tmp_path: Path, temp_dir: Path) -> None:
    """The error names the engine's log; that log is kept (the folder is temporary)."""
    path = config(tmp_path, free_port())
    path.write_text(path.read_text() + 'env = { STANDIN_EXIT = "1" }\n')  # model b fails
    env = environment(temp_dir, tmp_path / "ledger")
    proc = subprocess.run(
        [sys.executable, "-m", "elastickv.cli.main", "serve", "--config", str(path)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "engine logs kept in" in proc.stderr, proc.stderr
    named = re.search(r"log (\S+/b\.log):", proc.stderr)
    assert named is not None, proc.stderr
    assert "failing on purpose" in Path(named.group(1)).read_text()
    assert "stopped: 1 engine, nothing left" in proc.stderr  # a, which had started


KEY = "s3cret-" + "k" * 25


def call(
    port: int, method: str, path: str, body: Any = None, key: str | None = KEY
) -> tuple[int, Any]:
    """An HTTP call to serve: (status, JSON answer)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data, headers=headers, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_added_and_removed_at_run_time(tmp_path: Path, temp_dir: Path) -> None:
    """``--models-api`` with no model at start: a model added answers once its engine is
    healthy and is served; a bad one is refused before anything starts, one that cannot
    start leaves nothing; a removal waits for the model's request in flight, then stops its
    engine and forgets it. The key is never in the log."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    env = {**environment(temp_dir, tmp_path / "ledger"), "ELASTICKV_API_KEY": KEY}
    port = free_port()
    serve = Serve(
        ["--models-api", "--budget", "8M", "--page-size", "64K", "--port", str(port),
         "--python", sys.executable],
        env,
    )  # fmt: skip
    table = {"name": "a", "model": str(model_dir), "min_kv": "1M", "release_after": "never"}
    try:
        serve.wait_for("serving no models yet at")
        assert call(port, "POST", "/admin/models", table, key=None)[0] == 401
        assert call(port, "POST", "/admin/models", table, key=KEY + "x")[0] == 401
        status, added = call(port, "POST", "/admin/models", table)
        assert status == 200 and added["model"]["state"] == "idle", added
        assert added["model"]["engine_pid"] > 0
        assert call(port, "POST", "/v1/completions", {"model": "a", "prompt": "x"})[0] == 200
        assert elastickv_list(env)["a"]["record"] is not None
        # Refused before anything starts, each with its reason.
        status, answer = call(port, "POST", "/admin/models", table)
        assert status == 409 and "served already" in answer["error"]["message"]
        status, answer = call(port, "POST", "/admin/models", {**table, "name": "b", "min_kv": "3X"})
        assert status == 400 and "min_kv = '3X': not a size" in answer["error"]["message"]
        status, answer = call(port, "POST", "/admin/models", {**table, "name": "b", "min_kv": "8M"})
        assert status == 409 and "cannot guarantee the models' min_kv" in answer["error"]["message"]
        status, answer = call(port, "POST", "/admin/models", {**table, "name": "b", "pd": True})
        assert status == 400 and "pd models" in answer["error"]["message"]
        # An engine that cannot start: a 502 naming its log, nothing of it left.
        failing = {**table, "name": "b", "env": {"STANDIN_EXIT": "1"}}
        status, answer = call(port, "POST", "/admin/models", failing)
        assert status == 502 and "b.log" in answer["error"]["message"], answer
        assert [m["id"] for m in call(port, "GET", "/v1/models")[1]["data"]] == ["a"]
        assert "b" not in elastickv_list(env)
        # A removal waits for the request in flight: new requests are refused at once (404),
        # the held one is answered once the gate opens, then the engine stops.
        # The held request is in flight once a is serving again after the first request
        # ended: that request's "idle -> serving" is logged already, and waiting for any such
        # line let the removal begin before the held request arrived (a 404).
        idle = serve.wait_for("a: serving -> idle")
        replies: queue.Queue[tuple[int, Any]] = queue.Queue()
        hold = {"model": "a", "prompt": "hold"}
        threading.Thread(
            target=lambda: replies.put(call(port, "POST", "/v1/completions", hold)), daemon=True
        ).start()
        serve.wait_for("a: idle -> serving", after=idle)
        removals: queue.Queue[tuple[int, Any]] = queue.Queue()
        threading.Thread(
            target=lambda: removals.put(call(port, "DELETE", "/admin/models/a?drain=60")),
            daemon=True,
        ).start()
        while call(port, "POST", "/v1/completions", {"model": "a", "prompt": "x"})[0] != 404:
            time.sleep(0.05)  # until the removal has begun: a is no longer routed
        assert removals.empty()  # still draining: the held request is in flight
        (temp_dir / "gate").touch()
        assert replies.get(timeout=60)[0] == 200
        status, removed = removals.get(timeout=60)
        assert status == 200 and removed["requests_cut_short"] == 0
        assert removed["engine_pid"] == added["model"]["engine_pid"]
        assert call(port, "GET", "/v1/models")[1]["data"] == []
        assert elastickv_list(env) == {}
        assert call(port, "DELETE", "/admin/models/a")[0] == 404
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(serve.proc.pid, signal.SIGTERM)
    lines = serve.rest()
    assert serve.proc.returncode == 0, "\n".join(lines)
    assert any(line.endswith("a: removed") for line in lines)
    # b's log is kept: it failed to start.
    assert "elastickv serve: stopped: 0 engines, nothing left; engine logs kept in" in lines[-1]
    assert lines[-1].endswith("(b failed to start)"), lines[-1]
    assert all(KEY not in line for line in lines)


def wait_gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


PARENT = """
import subprocess, sys, time
log = open(sys.argv[1], "w")
argv = [sys.executable, "-m", "elastickv.cli.main", "serve", *sys.argv[2:]]
proc = subprocess.Popen([*argv, "--exit-with-parent", str(__import__("os").getpid())],
                        stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
print(proc.pid, flush=True)
time.sleep(3600)
"""


def test_serve_started_with_exit_with_parent_stops_when_its_parent_dies(
    tmp_path: Path, temp_dir: Path
) -> None:
    """``--exit-with-parent PID`` (how a cluster replica starts its serve, without running
    Python between fork and exec): when that parent is killed with -9, serve gets SIGTERM,
    stops its engines and exits; nothing is left. A parent already gone: serve ends at once."""
    env = environment(temp_dir, tmp_path / "ledger")
    log = tmp_path / "serve.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(log), "--config", str(config(tmp_path, free_port()))],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert parent.stdout is not None
    serve_pid = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 120
        while "serving a, b at" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while not any(line.endswith("nothing left") for line in log.read_text().splitlines()):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    assert log.read_text().splitlines()[-1].endswith("stopped: 2 engines, nothing left")
    assert wait_gone(serve_pid)
    gone = subprocess.run(
        [sys.executable, "-m", "elastickv.cli.main", "serve", "--check", "--exit-with-parent",
         "1"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert gone.returncode == -signal.SIGTERM  # its parent is not pid 1: it ended at once
