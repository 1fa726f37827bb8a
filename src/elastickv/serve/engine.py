"""One model's vLLM OpenAI server: the command and environment, the process, its health.

The engine is started in a session of its own (so Ctrl-C in the operator's terminal reaches
``elastickv serve``, which stops the engines in order) and with a parent-death signal: if
``elastickv serve`` itself dies, even by ``kill -9``, the kernel sends the API server SIGTERM,
and elastickv's plugin makes its engine core follow (see
:mod:`elastickv.integrations.vllm.engine.watchdog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from elastickv.integrations.vllm.engine.floor import stated_floor
from elastickv.ports import free_port
from elastickv.serve.config import ModelConfig, ServeConfig, has_option
from elastickv.serve.leftovers import (
    make_rpc_dir,
    private_shared_memory,
    private_temp_env,
    remove_leftovers,
)
from elastickv.units import format_size

PR_SET_PDEATHSIG = 1
# ``ELASTICKV_*`` settings of serve's own environment that its engines inherit; every other one
# is set by serve from the configuration.
PASSED_SETTINGS = ("ELASTICKV_LEDGER_DIR", "ELASTICKV_CHECK_COMMITS", "ELASTICKV_STRICT")
# ``ELASTICKV_*`` settings serve's own process reads (where it builds the built-in models; the
# router's API key). Never passed to the engines.
SERVE_SETTINGS = ("ELASTICKV_MODEL_CACHE", "ELASTICKV_API_KEY")


def ignored_settings(environ: Mapping[str, str]) -> list[str]:
    """The ``ELASTICKV*`` variables of serve's environment that change nothing: serve sets
    its engines' settings from the configuration (a typo would otherwise go unnoticed)."""
    used = {*PASSED_SETTINGS, *SERVE_SETTINGS}
    return sorted(k for k in environ if k.startswith("ELASTICKV") and k not in used)


# How long an engine's HTTP server keeps an idle connection open (vLLM's own default is 5 s).
# The router's client gives up on an idle connection well before (ROUTER_KEEP_ALIVE_S), so it
# never sends a request down a connection the engine is closing at that instant: that race
# was a 502 for a healthy engine.
ENGINE_KEEP_ALIVE_S = 60
ROUTER_KEEP_ALIVE_S = 30.0
# The KV connector of a P/D model's engines: NIXL, host buffers (vLLM's CPU backend reads and
# writes the KV cache in place).
PD_KV_TRANSFER_CONFIG = json.dumps(
    {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
)
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl  # resolved before any fork: the child only calls it


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy; the message carries its log's tail."""


def min_kv_hint(launch: EngineLaunch, log: str) -> str:
    """Serve's setting to change when an elastic engine refused to start below its minimum:
    serve hands it the model's ``min_kv`` as ``ELASTICKV_BUDGET``, which the engine's own
    message names (empty when the log states no minimum above what it was given)."""
    floor = stated_floor(log)
    given = launch.env.get("ELASTICKV_BUDGET")
    if floor is None or given is None or not given.isdigit() or int(given) >= floor:
        return ""
    return (
        f": its min_kv, {format_size(int(given))}, is below the least it starts with, "
        f"{format_size(floor)} (its null block's pages; serve gives the engine its min_kv "
        f'as ELASTICKV_BUDGET); set min_kv = "{format_size(floor)}" or more for it, or a '
        "smaller [device] page_size"
    )


@dataclass(frozen=True)
class EngineLaunch:
    """Everything needed to start one engine."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    port: int
    log_path: Path

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def build_launch(
    config: ServeConfig,
    model: ModelConfig,
    *,
    python: str,
    model_path: str,
    port: int,
    log_dir: Path,
    base_env: Mapping[str, str] | None = None,
) -> EngineLaunch:
    """The engine's command line and environment.

    ``ELASTICKV=1`` with the model's served name as its ledger instance, ``min_kv`` as its
    starting limit and its cap as the virtual KV capacity vLLM sees. ``--kv-cache-memory-bytes``
    (the cap) skips vLLM's start-up check of free host memory, which a second engine on the
    same host would otherwise fail. In static mode (a baseline) the engine is native vLLM
    whose KV cache is its fixed share of the budget.

    The engines of a P/D model answer to their pair's name and get vLLM's NixlConnector
    (``kv_both``: the router decides which engine prefills) with a NIXL side channel port of
    their own."""
    cap = config.cap_of(model)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    argv += ["--served-model-name", model.served_name, "--host", "127.0.0.1"]
    argv += ["--port", str(port)]
    if not has_option(model.args, "--kv-cache-memory-bytes"):
        argv += ["--kv-cache-memory-bytes", str(cap)]
    if model.role is not None:
        argv += ["--kv-transfer-config", PD_KV_TRANSFER_CONFIG]
    argv += engine_args(model)
    env = {
        k: v
        for k, v in (os.environ if base_env is None else base_env).items()
        if not k.startswith("ELASTICKV")
    }
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.update(model.env)
    env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(ENGINE_KEEP_ALIVE_S)
    if model.role is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    if config.static:  # the baseline: native vLLM with its fixed share of the budget
        return EngineLaunch(model.name, tuple(argv), env, port, log_path(log_dir, model.name))
    env.update(
        ELASTICKV="1",
        ELASTICKV_INSTANCE=model.name,
        ELASTICKV_BUDGET=str(model.min_kv),
        ELASTICKV_VIRTUAL_CAPACITY=str(cap),
        ELASTICKV_PAGE_SIZE=str(config.page_size),
        ELASTICKV_HOT_MAX_PAGES=str(config.hot_max_pages),
    )
    if model.nixl_progress_wait_ms is not None:
        env["ELASTICKV_NIXL_PROGRESS_WAIT_MS"] = str(model.nixl_progress_wait_ms)
    source = os.environ if base_env is None else base_env
    for passed in PASSED_SETTINGS:  # where the ledger is, and debugging aids
        if source.get(passed):
            env[passed] = source[passed]
    return EngineLaunch(model.name, tuple(argv), env, port, log_path(log_dir, model.name))


def engine_args(model: ModelConfig) -> list[str]:
    """The model's own vLLM arguments: its ``args``, after the dtype of a built-in model
    unless ``args`` set one (vLLM's ``--dtype auto`` would run the float32 ``tiny-llama``
    in bfloat16 on a CPU)."""
    if model.builtin and not has_option(model.args, "--dtype"):
        from elastickv.models import get_builtin_model

        return [*get_builtin_model(model.source).vllm_args, *model.args]
    return list(model.args)


def log_path(log_dir: Path, name: str) -> Path:
    """The engine log of model ``name`` (the name made safe for a file name)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return log_dir / f"{safe}.log"


def stop_session(proc: subprocess.Popen[Any], timeout: float = 60.0) -> list[int]:
    """Stop a process started with ``start_new_session``: SIGTERM to its whole session's
    group, wait up to ``timeout`` s for it, then SIGKILL the group. Returns the pids of its
    session still alive afterwards (none, normally)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return [p.pid for p in session_processes(proc.pid)]


def session_processes(sid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of session ``sid``: what a process started with
    ``start_new_session`` left running, however deep its children were re-parented."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def exit_with_parent(parent_pid: int) -> None:
    """In this process: SIGTERM when the thread of ``parent_pid`` that started it ends (with
    its process), and at once if that parent is already gone. For a process its parent starts
    without a ``preexec_fn`` (a Ray worker may not run Python between fork and exec: gRPC's
    fork handlers abort the child)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent(parent_pid: int) -> None:
    """In a forked child, before exec: SIGTERM when the thread that started it ends (with
    its process); exit at once if the parent is already gone."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


class EngineProcess:
    """A started engine: its process group, exit, health, and stopping it."""

    def __init__(
        self, launch: EngineLaunch, proc: asyncio.subprocess.Process, rpc_dir: Path
    ) -> None:
        self.launch = launch
        self.proc = proc
        self.rpc_dir = rpc_dir
        self.shared_memory: set[Path] = set()  # see :meth:`note_shared_memory`
        self.started_at = time.monotonic()
        self.stopping = False

    @classmethod
    async def start(cls, launch: EngineLaunch) -> EngineProcess:
        launch.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        me = os.getpid()
        try:
            rpc_dir = make_rpc_dir()
        except ValueError as exc:
            raise EngineStartError(str(exc)) from None
        try:
            with launch.log_path.open("ab") as log:
                os.chmod(launch.log_path, 0o600)
                proc = await asyncio.create_subprocess_exec(
                    *launch.argv,
                    env=private_temp_env(launch.env, rpc_dir),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=lambda: die_with_parent(me),
                )
        except BaseException:
            remove_leftovers(rpc_dir)
            raise
        return cls(launch, proc, rpc_dir)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exited(self) -> bool:
        return self.proc.returncode is not None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.launch.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout: float) -> float:
        """Seconds until ``/health`` answered 200; EngineStartError if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.exited:
                tail = self.log_tail()
                raise EngineStartError(
                    f"the engine of {self.launch.name!r} exited during start-up (status "
                    f"{self.proc.returncode}){min_kv_hint(self.launch, tail)}; log "
                    f"{self.launch.log_path}:\n{tail}"
                )
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(
                    self.launch.url("/health"), timeout=aiohttp.ClientTimeout(total=2)
                ) as response:
                    if response.status == 200:
                        return time.monotonic() - self.started_at
            await asyncio.sleep(0.25)
        raise EngineStartError(
            f"the engine of {self.launch.name!r} was not healthy after {timeout:.0f} s; log "
            f"{self.launch.log_path}:\n{self.log_tail()}"
        )

    def note_shared_memory(self) -> None:
        """Remember vLLM's private shared-memory files the engine maps now (once healthy),
        to remove whatever of them it leaves (see ``PRIVATE_SHM_NAME``)."""
        self.shared_memory |= private_shared_memory(p.pid for p in self.processes())

    def processes(self) -> list[psutil.Process]:
        """Every live process of the engine: its session (API server, engine core, workers)."""
        return session_processes(self.pid)

    def resident_bytes(self) -> int | None:
        """What the engine holds in memory: the PSS of its API server and every process it
        started (engine core, workers); None once it is gone. A few system calls per process:
        call it off the event loop."""
        try:
            root = psutil.Process(self.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_full_info().pss
        return total

    async def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (vLLM's clean shutdown; SIGCONT too, so that a stopped engine acts on it
        at once), then SIGKILL to whatever of its session is left."""
        self.stopping = True
        if not self.exited:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGCONT)  # a stopped (SIGSTOP) engine takes it now
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), timeout)
        deadline = time.monotonic() + 5.0
        while self.processes() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        self.kill()
        with contextlib.suppress(ProcessLookupError):
            await self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the whole engine now (every process of its session), and remove what it
        leaves: its IPC directory and its private shared memory. Every way an engine ends
        comes here: a stop, an unexpected exit, serve's exit."""
        self.stopping = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        remove_leftovers(self.rpc_dir, self.shared_memory)
