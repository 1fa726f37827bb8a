"""Helpers for the ``elastickv serve`` tests: the real command, real HTTP, the real ledger.

Nothing here stands in for vLLM or the router: ``elastickv serve`` runs as a subprocess with
real vLLM engines, requests go over loopback HTTP, and memory is read from the ledger and the
engines' memfds.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elastickv.control import open_ledger
from elastickv.serve.engine import session_processes as engine_session_processes
from elastickv.serve.engine import stop_session


@dataclass
class Reply:
    status: int
    body: dict[str, Any] | None
    text: str = ""  # completion text (streams: concatenated deltas)
    token_ids: list[int] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    error_event: dict[str, Any] | None = None  # an error event inside a stream
    seconds: float = 0.0


def _open(url: str, body: dict[str, Any] | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def post(
    base: str,
    path: str,
    body: dict[str, Any],
    timeout: float = 300,
    streaming: threading.Event | None = None,
    began: threading.Event | None = None,
) -> Reply:
    """POST and read the whole answer; streams are parsed event by event (``began`` is set
    once a stream's status and headers arrived, ``streaming`` at its first event)."""
    start = time.monotonic()
    try:
        response = _open(base + path, body, timeout)
    except urllib.error.HTTPError as exc:
        payload = json.loads(exc.read() or b"null")
        return Reply(exc.code, payload, headers=dict(exc.headers), seconds=time.monotonic() - start)
    with response:
        headers = dict(response.headers)
        if began is not None:
            began.set()
        if not body.get("stream"):
            payload = json.loads(response.read())
            choice = payload["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return Reply(
                response.status, payload, text or "", choice.get("token_ids"), headers,
                seconds=time.monotonic() - start,
            )  # fmt: skip
        text, error = [], None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if streaming is not None:
                streaming.set()
            if "error" in event:
                error = event
                continue
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content") if "delta" in choice else None
                text.append(delta if delta is not None else choice.get("text") or "")
        return Reply(
            response.status, None, "".join(text), None, headers, error,
            seconds=time.monotonic() - start,
        )  # fmt: skip


def get_json(base: str, path: str) -> Any:
    with _open(base + path, None, 30) as response:
        return json.loads(response.read())


def complete(model: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }  # fmt: skip


def chat(model: str, content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra,
    }  # fmt: skip


def top_logprobs(reply: Reply) -> list[dict[int, float]] | None:
    """Per generated token of a completion, the logprobs vLLM returned (the chosen token and
    the most likely ones) by token id; None if the request did not ask for them (it needs
    ``logprobs`` and ``return_tokens_as_token_ids``)."""
    if reply.body is None or not reply.body["choices"][0].get("logprobs"):
        return None
    steps = reply.body["choices"][0]["logprobs"]["top_logprobs"]
    return [{int(k.removeprefix("token_id:")): v for k, v in step.items()} for step in steps]


def greedy_mismatch(
    want_ids: list[int],
    want_top: list[dict[int, float]],
    got_ids: list[int],
    got_top: list[dict[int, float]],
    tie: float,
) -> str | None:
    """Whether ``got_ids`` is what greedy decoding gives, judged against a reference run of the
    same request; None if so, else where and why not.

    Greedy ids are a function of the logits only up to rounding, and rounding depends on the
    batch a token was computed in. So: up to the first token where the runs differ, every
    token and its logprob must agree (within ``tie``); at that token both runs must have seen
    the two candidates within ``tie`` of each other (a near-tie that another batch may break
    either way). After it the two contexts differ and nothing more is compared."""
    if len(got_ids) != len(want_ids) or len(got_top) != len(got_ids):
        return f"{len(got_ids)} tokens, expected {len(want_ids)}"
    for k, (want, got) in enumerate(zip(want_ids, got_ids, strict=True)):
        mine, theirs = got_top[k], want_top[k]
        if want == got:
            if abs(mine[got] - theirs[want]) > tie:
                return f"token {k} ({got}): logprob {mine[got]}, expected {theirs[want]}"
            continue
        if got not in theirs or want not in mine:
            return f"token {k}: {got}, expected {want} (not a near-tie: {mine} vs {theirs})"
        if theirs[want] - theirs[got] > tie or mine[got] - mine[want] > tie:
            return f"token {k}: {got}, expected {want} (not a near-tie: {mine} vs {theirs})"
        return None
    return None


def post_all(base: str, requests: list[tuple[str, dict[str, Any]]]) -> list[Reply]:
    """All at once, a thread each: the engine batches them as they happen to arrive."""
    with ThreadPoolExecutor(max(1, len(requests))) as pool:
        return list(pool.map(lambda r: post(base, r[0], r[1]), requests))


def post_each(base: str, requests: list[tuple[str, dict[str, Any]]]) -> list[Reply]:
    """One after another: each request is computed alone, so its output does not depend on
    how concurrent requests happened to be batched (in bf16 that moves greedy ids)."""
    return [post(base, path, body) for path, body in requests]


def session_processes(sid: int) -> list[int]:
    """Pids of the live (non-zombie) processes of session ``sid``."""
    return [p.pid for p in engine_session_processes(sid)]


def engine_cores(sid: int) -> list[int]:
    """Pids of the vLLM engine-core processes (``VLLM::EngineCore``) of session ``sid``."""
    found = []
    for proc in engine_session_processes(sid):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in " ".join(proc.cmdline()):
                found.append(proc.pid)
    return found


def rpc_dir(pid: int) -> dict[str, Any]:
    """The IPC socket directory serve gave engine ``pid`` (its ``VLLM_RPC_BASE_PATH``): its
    path, mode and the sockets in it now."""
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, _, value = item.partition(b"=")
        if name == b"VLLM_RPC_BASE_PATH":
            path = Path(os.fsdecode(value))
            return {
                "path": path,
                "mode": stat.S_IMODE(path.stat().st_mode),
                "sockets": sum(stat.S_ISSOCK(p.lstat().st_mode) for p in path.iterdir()),
            }
    raise AssertionError(f"engine {pid} has no VLLM_RPC_BASE_PATH")


def wait_until(predicate: Any, timeout: float, interval: float = 0.1) -> float | None:
    """Seconds until ``predicate()`` is true, or None after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    return None


class LedgerSampler:
    """Samples the ledger every ``interval`` s in a thread: per-instance used bytes and limits;
    also the largest kernel footprint seen of each file in ``files`` (e.g. an engine's KV
    memfd under ``/proc``), in ``peak_footprint``."""

    def __init__(
        self, ledger_dir: Path, interval: float = 0.02, files: tuple[str, ...] = ()
    ) -> None:
        self.ledger_dir = ledger_dir
        self.interval = interval
        self.samples: list[dict[str, tuple[int, int | None]]] = []
        self.files = files
        self.peak_footprint = dict.fromkeys(files, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, ledger: Any) -> None:
        snap = ledger.snapshot()
        self.samples.append({i.name: (i.used_bytes, i.limit_desired) for i in snap.instances})
        for path in self.files:
            with contextlib.suppress(OSError):
                footprint = os.stat(path).st_blocks * 512
                self.peak_footprint[path] = max(self.peak_footprint[path], footprint)

    def _sample_once(self) -> None:
        with open_ledger("host", directory=str(self.ledger_dir), create=False) as ledger:
            self._sample(ledger)

    def _run(self) -> None:
        with open_ledger("host", directory=str(self.ledger_dir), create=False) as ledger:
            while not self._stop.wait(self.interval):
                self._sample(ledger)

    def __enter__(self) -> LedgerSampler:
        """The first sample is taken here, before anything the block does."""
        self._sample_once()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """The last sample is taken here, after everything the block waited for."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample_once()

    def peak_used(self, name: str) -> int:
        """The most ``name`` held (committed and credit) in any sample so far."""
        return max((s.get(name, (0, None))[0] for s in list(self.samples)), default=0)

    def peak_total(self) -> int:
        return max((sum(u for u, _ in s.values()) for s in self.samples), default=0)

    def limits(self, name: str) -> list[int]:
        """The distinct limits of ``name`` in sampling order."""
        out: list[int] = []
        for sample in self.samples:
            limit = sample.get(name, (0, None))[1]
            if limit is not None and (not out or out[-1] != limit):
                out.append(limit)
        return out


@contextlib.contextmanager
def serve_process(
    config: Path, env: dict[str, str], log: Path, port: int, timeout: float = 600
) -> Iterator[subprocess.Popen[bytes]]:
    """``elastickv serve --config`` in its own session, ready when every model is up."""
    cmd = [sys.executable, "-m", "elastickv.cli.main", "serve", "--config", str(config)]
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
                )
            with contextlib.suppress(OSError, ValueError):
                models = get_json(base, "/v1/models")["data"]
                if all(m["state"] in ("idle", "serving", "kv-released") for m in models):
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"serve not ready in {timeout} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield proc
    finally:
        stop_session(proc)
