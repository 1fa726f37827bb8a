"""Helpers for the ``elastickv cluster`` test: the Ray cluster of this machine (two nodes and
more, ``ray_cluster.py``), the command as a user runs it, the processes of each node, Ray's
Prometheus export.

Nothing here stands in for Ray Serve, elastickv serve or vLLM: they run for real; this only
starts, reads and stops them.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import select
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

CLUSTER = Path(__file__).with_name("ray_cluster.py")
CLUSTER_START_S = 180


class RayCluster:
    """``ray_cluster.py`` with a spec; nodes removed and added by command."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str], log: Path) -> None:
        with log.open("w") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, str(CLUSTER), json.dumps(spec)], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, text=True,
            )  # fmt: skip
        self.log = log
        self.description = self._answer(CLUSTER_START_S)

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("{"):
            raise AssertionError(f"ray_cluster.py said {line!r}:\n{self.log.read_text()[-4000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def command(self, line: str, timeout: float = 180) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def stop(self) -> dict[str, Any]:
        """Close stdin (the cluster shuts down): its exit code and last word."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            said = self.proc.stdout.read()
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code, said = self.proc.wait(), ""
        return {"returncode": code, "said": said.strip()}


class Command:
    """A command in the background, its output (stdout and stderr) read line by line."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float) -> str:
        """The first line (from now on) matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"ended before {pattern!r}:\n" + "\n".join(self.lines[-80:]))
            self.lines.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(
            f"{pattern!r} not said in {timeout} s:\n" + "\n".join(self.lines[-80:])
        )

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return code


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]
    text: str = ""  # a stream's text, its deltas joined
    error_event: dict[str, Any] | None = None


def request(
    base: str, method: str, path: str, body: Any = None, key: str | None = None,
    timeout: float = 600,
) -> Reply:  # fmt: skip
    """One HTTP call; a stream is read event by event."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    call = urllib.request.Request(base + path, data, headers=headers, method=method)
    try:
        answer = urllib.request.urlopen(call, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        with contextlib.suppress(ValueError):
            return Reply(exc.code, json.loads(raw), dict(exc.headers))
        return Reply(exc.code, raw.decode(errors="replace"), dict(exc.headers))
    with answer:
        headers_in = {k.lower(): v for k, v in answer.headers.items()}
        if not (isinstance(body, dict) and body.get("stream")):
            return Reply(answer.status, json.loads(answer.read()), headers_in)
        pieces, error = [], None
        for raw_line in answer:
            line = raw_line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                error = event
                continue
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content") if "delta" in choice else None
                pieces.append(delta if delta is not None else choice.get("text") or "")
        return Reply(answer.status, None, headers_in, "".join(pieces), error)


def environ_of(proc: psutil.Process) -> dict[str, str]:
    with contextlib.suppress(psutil.Error):
        return dict(proc.environ())
    return {}


def mine(token_name: str, token: str) -> list[psutil.Process]:
    """Live processes whose environment carries the test's token."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if environ_of(proc).get(token_name) == token and proc.status() != "zombie":
                found.append(proc)
    return found


def serves(processes: list[psutil.Process]) -> dict[str, dict[str, Any]]:
    """The replicas' ``elastickv serve`` processes among ``processes``, by their node's ledger
    directory: pid, port, the replica's pid (serve's parent)."""
    found = {}
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            argv = proc.cmdline()
            if "elastickv.cli.main" in argv and "serve" in argv and "--port" in argv:
                ledger = environ_of(proc)["ELASTICKV_LEDGER_DIR"]
                found[ledger] = {
                    "pid": proc.pid,
                    "port": int(argv[argv.index("--port") + 1]),
                    "replica_pid": proc.ppid(),
                }
    return found


def engine_servers(processes: list[psutil.Process]) -> dict[tuple[str, str], int]:
    """(node's ledger directory, model) -> pid of the model's vLLM API server."""
    found = {}
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            if "vllm.entrypoints.openai.api_server" in proc.cmdline():
                env = environ_of(proc)
                found[(env["ELASTICKV_LEDGER_DIR"], env["ELASTICKV_INSTANCE"])] = proc.pid
    return found


_SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric ``name`` in Prometheus text: (labels, value)."""
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name:
            found.append((dict(_LABEL.findall(match.group(2))), float(match.group(3))))
    return found


def requests_by_replica(texts: list[str]) -> Counter[tuple[str, str, str]]:
    """(replica, model, status) -> requests, summed over the nodes' exports."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for text in texts:
        for labels, value in metric_samples(text, "ray_elastickv_cluster_requests_total"):
            counts[(labels["replica"], labels["model"], labels["status"])] += int(value)
    return counts


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text: str = answer.read().decode()
        return text


def files_holding(root: Path, secret: str, skip: set[Path]) -> list[str]:
    """Every regular file under ``root`` (but ``skip``) whose bytes contain ``secret``."""
    needle = secret.encode()
    found = []
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            if path in skip or not path.is_file() or path.is_symlink():
                continue
            if needle in path.read_bytes():
                found.append(str(path))
    return found


def wait_until(predicate: Any, timeout: float, interval: float = 0.25) -> float | None:
    """Seconds until ``predicate()`` is true, or None after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    return None
