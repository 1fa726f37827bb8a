"""Shared helpers for the vLLM plugin tests: hermetic environments, engine runs, the server.

Every engine runs in its own subprocess so each run is a clean vLLM process tree; native and
elastic runs differ only in ``ELASTICKV*`` variables (and the multiprocessing switch).
"""

from __future__ import annotations

import contextlib
import json
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elastickv.ports import free_port

RUNNER = Path(__file__).with_name("vllm_runner.py")
PAGE = 32 << 10
HOT_MAX_PAGES = 4
ELASTIC = {
    "ELASTICKV": "1",
    "ELASTICKV_PAGE_SIZE": str(PAGE),
    "ELASTICKV_HOT_MAX_PAGES": str(HOT_MAX_PAGES),
    "ELASTICKV_VIRTUAL_CAPACITY": "256M",
    "ELASTICKV_CHECK_COMMITS": "1",
}
ENGINE_ARGS = {
    "dtype": "auto",
    "enforce-eager": None,
    "max-model-len": "256",
    "block-size": "32",
    "kv-cache-memory-bytes": str(32 << 20),
    "seed": "0",
}


def hermetic_env(cache_root: Path, extra: dict[str, str], *, multiprocess: bool) -> dict[str, str]:
    """This process's environment minus any ``ELASTICKV*``, offline, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")}
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(cache_root),
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
        # Elastic engines register in a ledger: the suite's own, never the user's.
        ELASTICKV_LEDGER_DIR=str(cache_root / "ledger"),
    )
    env.update(extra)
    return env


def run_engine(
    cache_root: Path, model: str, args: list[str], extra: dict[str, str], *, multiprocess: bool
) -> dict[str, Any]:
    """Run ``vllm_runner.py`` once; its JSON result, with ``wall_s`` added."""
    return finish_engine(start_engine(cache_root, model, args, extra, multiprocess=multiprocess))


@dataclass
class EngineProc:
    """A ``vllm_runner.py`` started in the background (see :func:`finish_engine`)."""

    proc: subprocess.Popen[str]
    started: float
    audit: Path


# Put first on an engine's PYTHONPATH: every Python process of the engine records any open
# of another process's fd through /proc into the audit log (see its ``sitecustomize``).
PROC_AUDIT = Path(__file__).with_name("proc_audit")


def audited(env: dict[str, str], log: Path) -> dict[str, str]:
    """``env`` with the /proc fd audit on, logging to ``log``."""
    path = [str(PROC_AUDIT), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(path), "PROC_FD_AUDIT_LOG": str(log)}


def start_engine(
    cache_root: Path, model: str, args: list[str], extra: dict[str, str], *, multiprocess: bool
) -> EngineProc:
    fd, name = tempfile.mkstemp(prefix="proc-fd-audit-", dir=cache_root)
    os.close(fd)
    audit = Path(name)
    env = audited(hermetic_env(cache_root, extra, multiprocess=multiprocess), audit)
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), model, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return EngineProc(proc, time.monotonic(), audit)


FAILALLOC_SOURCE = Path(__file__).parent / "failalloc" / "failalloc.c"
FAILALLOC = Path(__file__).resolve().parents[2] / "build" / "failalloc" / "libfailalloc.so"


def failalloc_library() -> Path:
    """The fallocate shim (``failalloc/failalloc.c``), compiled unless an up-to-date build is
    there (the system C compiler, as for the fake CUDA driver)."""
    if FAILALLOC.exists() and FAILALLOC.stat().st_mtime >= FAILALLOC_SOURCE.stat().st_mtime:
        return FAILALLOC
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert compiler, "no C compiler: install gcc or set CC (the fallocate shim is compiled)"
    FAILALLOC.parent.mkdir(parents=True, exist_ok=True)
    partial = FAILALLOC.with_name(f"libfailalloc.{os.getpid()}.tmp")
    command = [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra"]
    command += ["-o", str(partial), str(FAILALLOC_SOURCE), "-ldl"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"compiling the fallocate shim failed:\n{done.stderr}"
    os.replace(partial, FAILALLOC)
    return FAILALLOC


def proc_fd_opens(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every open of another process's fd through /proc by an engine process of a run (the
    runner's own probe, which reads the workers' footprints for the test, excluded)."""
    return [line for line in result["proc_fd_opens"] if line["pid"] != result["runner_pid"]]


def failure_report(stdout: str, stderr: str, limit: int = 4000) -> str:
    """What a failed engine run said: the first ``ERROR`` lines of vLLM's log and the first
    traceback (a worker's or the engine core's exception, the root cause, comes long before
    the runner's own traceback at the end), then the end of stderr."""
    errors = [line for line in (stdout + "\n" + stderr).splitlines() if " ERROR " in line]
    first = stderr.find("Traceback")
    parts = [
        "vLLM's ERROR lines:\n" + ("\n".join(errors)[:limit] or "(none)"),
        "--- first traceback:\n" + (stderr[first : first + limit] if first >= 0 else "(none)"),
        "--- stderr (end):\n" + stderr[-limit:],
    ]
    return "\n".join(parts)


def finish_engine(engine: EngineProc, timeout: float = 600) -> dict[str, Any]:
    """Wait for the runner; its JSON result, with ``wall_s`` added (killed on timeout)."""
    try:
        stdout, stderr = engine.proc.communicate(timeout=timeout)
    finally:
        if engine.proc.poll() is None:
            # A hung engine: its workers would outlive the runner and spin, so kill the tree.
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(engine.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
            engine.proc.kill()
            engine.proc.wait()
    if engine.proc.returncode != 0:
        raise AssertionError(
            f"runner failed ({engine.proc.returncode}):\n{failure_report(stdout, stderr)}"
        )
    # The JSON document is the runner's last line; Ray's log forwarding may print after it.
    documents = [line for line in stdout.splitlines() if line.startswith('{"')]
    assert documents, f"runner printed no JSON document:\n{stdout[-2000:]}"
    result: dict[str, Any] = json.loads(documents[-1])
    result["wall_s"] = round(time.monotonic() - engine.started, 1)
    lines = engine.audit.read_text().splitlines()
    engine.audit.unlink()
    result["proc_fd_opens"] = [json.loads(line) for line in lines]
    return result


@dataclass
class Server:
    """A running OpenAI server; ``descendants`` is filled in while it serves."""

    proc: subprocess.Popen[bytes]
    port: int
    model: str
    log: Path
    descendants: dict[int, str] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get_status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url(path), timeout=5) as response:
                status: int = response.status
                return status
        except urllib.error.HTTPError as exc:
            return exc.code

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            self.url("/v1/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            choice: dict[str, Any] = json.loads(response.read())["choices"][0]
            return {"text": choice["text"], "token_ids": choice["token_ids"]}

    def complete_all(self, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))

    def snapshot_descendants(self) -> None:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                self.descendants[child.pid] = child.name()


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(
                f"server exited ({server.proc.returncode}):\n{server.log.read_text()[-4000:]}"
            )
        with contextlib.suppress(OSError):
            if server.get_status("/health") == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"server not ready in {timeout} s:\n{server.log.read_text()[-4000:]}")


@contextlib.contextmanager
def openai_server(
    cache_root: Path,
    model: str,
    extra: dict[str, str],
    log: Path,
    engine_args: dict[str, str | None] | None = None,
) -> Iterator[Server]:
    """Start ``vllm.entrypoints.openai.api_server`` on 127.0.0.1 and wait for ``/health``.

    On exit the caller has already sent SIGTERM (see :func:`terminate`); anything still
    alive here is killed so a failing test never leaks processes.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching"]
    for key, value in {**ENGINE_ARGS, **(engine_args or {})}.items():
        cmd += [f"--{key}"] + ([] if value is None else [value])
    env = hermetic_env(cache_root, extra, multiprocess=True)
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    server = Server(proc, port, model, log)
    try:
        _wait_ready(server, timeout=300)
        server.snapshot_descendants()
        yield server
    finally:
        for pid in [proc.pid, *server.descendants]:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        proc.wait(timeout=30)


def terminate(server: Server, timeout: float = 30) -> dict[str, Any]:
    """SIGTERM the server's pid; which of its processes are still alive after ``timeout``."""
    server.snapshot_descendants()
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=timeout)
    procs = []
    for pid in server.descendants:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=max(1.0, timeout - (time.monotonic() - start)))
    return {
        "returncode": code,
        "stop_s": round(time.monotonic() - start, 1),
        "left": {p.pid: server.descendants[p.pid] for p in alive},
    }


POOL_NAME = "memfd:elastickv-pool"


def pool_fds(pids: list[int]) -> dict[int, list[str]]:
    """``/proc/<pid>/fd/<n>`` paths of elastickv pools each process holds (by memfd name)."""
    held: dict[int, list[str]] = {}
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        with contextlib.suppress(OSError):
            for entry in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(entry).startswith(f"/{POOL_NAME}"):
                        held.setdefault(pid, []).append(str(entry))
    return held


def footprint_bytes(path: str) -> int:
    """The kernel's allocated bytes of the pool at ``path`` (its memfd ``st_blocks``)."""
    return os.stat(path).st_blocks * 512


def ledger_list(ledger_dir: Path | str) -> dict[str, Any]:
    """``elastickv list --json`` (the real console script) on the ledger in ``ledger_dir``."""
    script = Path(sys.executable).with_name("elastickv")
    env = dict(os.environ, ELASTICKV_LEDGER_DIR=str(ledger_dir))
    proc = subprocess.run(
        [str(script), "list", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    out.setdefault("instances", [])  # no ledger yet (nothing elastic ran): no instances
    return out


# -- the OpenAI server, one run per side (shared by the 0.28 and 0.32 server tests) ----------

SERVER_MAX_TOKENS = 24


def serve(
    cache_root: Path,
    log: Path,
    extra: dict[str, str],
    engine_args: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """One OpenAI server run: health, the ledger and pools while idle, the repeated functional
    prompts one at a time, 16 concurrent completions, health again, SIGTERM, the ledger after.
    ``engine_args`` add to (or override) :data:`ENGINE_ARGS` on the command line."""
    from vllm_runner import FUNCTIONAL, concurrent_prompts

    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    ledger_dir = cache_root / "ledger"
    started = time.monotonic()
    with openai_server(cache_root, model, extra, log, engine_args) as server:
        result: dict[str, Any] = {"health": server.get_status("/health"), "port": server.port}
        result["startup_s"] = round(time.monotonic() - started, 1)
        result["ledger"] = ledger_list(ledger_dir)["instances"]
        if "ELASTICKV_METRICS_PORT" in extra:
            url = f"http://127.0.0.1:{extra['ELASTICKV_METRICS_PORT']}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                result["metrics"] = response.read().decode()
        holders = pool_fds(list(server.descendants))
        result["pool_holders"] = len(holders)
        path = next((paths[0] for paths in holders.values()), None)
        result["idle_footprint"] = None if path is None else footprint_bytes(path)
        functional = [server.complete(p, SERVER_MAX_TOKENS) for p in FUNCTIONAL * 2]
        result["functional"] = [o["token_ids"] for o in functional]
        result["outputs"] = server.complete_all(concurrent_prompts(16), SERVER_MAX_TOKENS)
        result["after_footprint"] = None if path is None else footprint_bytes(path)
        if "ELASTICKV_METRICS_PORT" in extra:
            with urllib.request.urlopen(url, timeout=10) as response:
                result["metrics_after"] = response.read().decode()
        result["final_health"] = server.get_status("/health")
        result["shutdown"] = terminate(server)
    result["log"] = log.read_text(errors="replace")
    result["ledger_after"] = ledger_list(ledger_dir)["instances"]
    result["model"] = model
    return result


# -- start-ups that must fail ------------------------------------------------------------------

_FAILING_START = """
import json, sys
from vllm import LLM
kwargs = json.loads(sys.argv[2])
LLM(model=sys.argv[1], dtype="auto", enforce_eager=True, max_model_len=256, block_size=32,
    kv_cache_memory_bytes=32 << 20, seed=0, **kwargs)
print("ENGINE STARTED")
"""


def failing_start(
    cache_root: Path,
    model: str,
    llm_kwargs: dict[str, Any],
    extra: dict[str, str],
    ledger_dir: Path,
    *,
    multiprocess: bool = False,
) -> dict[str, Any]:
    """Start ``vllm.LLM`` in its own session, expecting it to fail: its return code and
    stderr, the processes of its session still running afterwards, the ledger's records."""
    env = hermetic_env(
        cache_root, {**extra, "ELASTICKV_LEDGER_DIR": str(ledger_dir)}, multiprocess=multiprocess
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", _FAILING_START, model, json.dumps(llm_kwargs)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its session id is its pid: finds every process it started
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = session_left(proc.pid)
    ledger = ledger_list(ledger_dir)["instances"] if ledger_dir.exists() else []
    return {
        "returncode": proc.returncode,
        "stdout": stdout,
        "stderr": stderr,
        "left": left,
        "ledger": ledger,
    }


# Only against a hang: how long the processes a stopped command started may take to exit.
SESSION_END_S = 60.0


def session_left(sid: int) -> list[int]:
    """The processes of session ``sid`` still running once they had ``SESSION_END_S`` to
    exit: children still exiting when their parent ended (multiprocessing's resource
    tracker, an engine core) are not taken for left behind."""
    from elastickv.serve.engine import session_processes

    deadline = time.monotonic() + SESSION_END_S
    while (left := [p.pid for p in session_processes(sid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


# What vLLM logs once it starts building the model: an early refusal must come before.
MODEL_LOADING_LINES = ("Starting to load model", "Loading weights", "Model loading took")


def assert_refused_before_weights(got: dict[str, Any]) -> None:
    """The failed start never reached model loading (judged from vLLM's own log lines)."""
    log = got["stdout"] + got["stderr"]
    reached = [line for line in MODEL_LOADING_LINES if line in log]
    assert not reached, f"refused only after model loading began ({reached}):\n{log[-3000:]}"


def assert_footprint_follows_blocks(elastic: dict[str, Any]) -> tuple[int, int]:
    """An elastic run's kernel footprint grows with live blocks and drains afterwards to the
    null block's pages plus at most the hot reserve; returns (idle, peak) bytes."""
    samples = elastic["samples"]
    peak = max(s["footprint_bytes"] for s in samples)
    idle = elastic["idle"]["footprint_bytes"]
    assert peak >= 4 * idle, (idle, peak)
    # The most-loaded step holds the most memory.
    busiest = max(samples, key=lambda s: s["live_blocks"])
    assert busiest["footprint_bytes"] == peak
    for s in samples:
        # The worker holds what the scheduler granted up to the last step it ran; the blocks
        # that step's requests freed go with the next step (or once the engine idles).
        assert s["footprint_bytes"] == s["granted_pages"] * PAGE
    after = elastic["after"]
    assert after["live_blocks"] == 0
    # The engine idled: every page operation reached the worker.
    assert after["footprint_bytes"] == after["committed_pages"] * PAGE
    null_pages = elastic["idle"]["committed_pages"]
    assert after["footprint_bytes"] <= (HOT_MAX_PAGES + null_pages) * PAGE
    return idle, peak


# -- multiprocess engine runs (0.32: the mp, ledger and validation-table tests) ---------------

# One set of runner arguments for every multiprocess run of a tiny-llama engine, so that the
# session's memoised runs (the ``runs`` fixture) start each side once for all those modules:
# an engine start is most of a test's time. The scheduler clock costs nothing measurable.
MP_RUN_ARGS = ("all", "--max-tokens", "64", "--no-prefix-caching", "--scheduler-clock")


# -- tensor parallelism (shared by the 0.28 and 0.32 TP tests) --------------------------------

TP = 2
# vLLM's CPU workers refuse to share one NUMA node's threads unless bound by hand.
TP_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# float32: in bfloat16 (what dtype "auto" picks on a CPU) TP=2's greedy ids depend on the
# batch's composition in native vLLM itself, so a run that preempts could not be compared.
TP_ARGS = ("--tensor-parallel-size", str(TP), "--dtype", "float32")
# 6 page indices on each rank: the null block's slab (2 float32 blocks of tiny-llama on 2
# pages) and two more slabs, 5 usable blocks: one request of 3 blocks at a time, and growth
# refused while two run. (Less would hang: a request that can never fit waits forever.)
TP_BUDGET = 12 * PAGE


def assert_ranks_exact(samples: list[dict[str, Any]], ranks: int = TP) -> None:
    """At every check, each rank's memfd (read through /proc by the runner) holds exactly
    what the scheduler granted it up to the step it ran, and the policy was charged for every
    page on all ranks."""
    assert samples
    for sample in samples:
        rank_footprints = sample["rank_footprint_bytes"]
        assert len(rank_footprints) == ranks
        assert rank_footprints == sample["rank_granted_bytes"], sample
        assert len(set(rank_footprints)) == 1, sample
        assert sample["admitted_bytes"] == sample["committed_pages"] * PAGE * ranks, sample
