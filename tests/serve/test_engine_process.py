"""An engine's process as serve starts and ends it, with small Python programs standing in
for vLLM (the real engines are in tests/integration_vllm/test_vllm_plugin_v032_serve.py): its
IPC sockets go to a directory of its own, owner-only, that is gone however the engine ends,
and vLLM's private shared memory it leaves in /dev/shm is removed with it."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from elastickv.serve.engine import EngineLaunch, EngineProcess, EngineStartError
from elastickv.serve.leftovers import (
    MAX_RPC_DIR_BYTES,
    PRIVATE_SHM_NAME,
    RPC_DIR_PREFIX,
    SHM_DIR,
    make_rpc_dir,
    remove_stale_rpc_dirs,
)

# What vLLM does with VLLM_RPC_BASE_PATH: bind ZeroMQ IPC sockets there, named by uuid, and
# leave the files behind when it is stopped. ``exit_after`` > 0: exit by itself (a crash).
ENGINE = """
import os, socket, sys, time, uuid
base = os.environ["VLLM_RPC_BASE_PATH"]
socks = []
for _ in range(3):
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(base, str(uuid.uuid4())))
    socks.append(s)
exit_after = float(sys.argv[1])
time.sleep(exit_after if exit_after > 0 else 3600)
os._exit(3)
"""


def launch(tmp_path: Path, exit_after: float = 0.0) -> EngineLaunch:
    argv = (sys.executable, "-c", ENGINE, str(exit_after))
    return EngineLaunch("m", argv, dict(os.environ), 1, tmp_path / "logs" / "m.log")


async def sockets_in(path: Path, count: int) -> list[Path]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = [p for p in path.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {count} sockets in {path}: {list(path.iterdir())}")


def test_sockets_go_to_an_owner_only_directory_removed_at_stop(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = await EngineProcess.start(launch(tmp_path))
        rpc = engine.rpc_dir
        try:
            assert rpc.name.startswith(RPC_DIR_PREFIX)
            assert rpc.parent == Path(tempfile.gettempdir())
            assert stat.S_IMODE(rpc.stat().st_mode) == 0o700
            assert len(await sockets_in(rpc, 3)) == 3
            environ = Path(f"/proc/{engine.pid}/environ").read_bytes().split(b"\0")
            assert f"VLLM_RPC_BASE_PATH={rpc}".encode() in environ
        finally:
            await engine.stop(timeout=5)
        assert engine.exited and not engine.processes()
        assert not rpc.exists()

    asyncio.run(scenario())


def test_an_engine_that_exits_by_itself_leaves_no_sockets_once_killed(tmp_path: Path) -> None:
    """The crash path: serve sees the exit and kills what is left of the engine's session."""

    async def scenario() -> None:
        engine = await EngineProcess.start(launch(tmp_path, exit_after=0.5))
        await sockets_in(engine.rpc_dir, 3)
        assert await engine.proc.wait() == 3
        assert engine.rpc_dir.exists()  # vLLM's leftovers, until serve takes the engine down
        engine.kill()
        assert not engine.rpc_dir.exists()

    asyncio.run(scenario())


def test_each_start_gets_its_own_directory(tmp_path: Path) -> None:
    async def scenario() -> None:
        first = await EngineProcess.start(launch(tmp_path))
        second = await EngineProcess.start(launch(tmp_path))
        try:
            assert first.rpc_dir != second.rpc_dir
        finally:
            await asyncio.gather(first.stop(timeout=5), second.stop(timeout=5))
        assert not first.rpc_dir.exists() and not second.rpc_dir.exists()

    asyncio.run(scenario())


def test_a_program_that_cannot_start_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tempfile.TemporaryDirectory(prefix="t-") as short:  # pytest's tmp_path is too long
        monkeypatch.setattr(tempfile, "tempdir", short)
        missing = EngineLaunch("m", (str(tmp_path / "no-python"),), {}, 1, tmp_path / "m.log")
        with pytest.raises(FileNotFoundError):
            asyncio.run(EngineProcess.start(missing))
        assert os.listdir(short) == []


def test_a_temporary_directory_too_long_for_sockets_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * max(1, MAX_RPC_DIR_BYTES - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(ValueError, match="set TMPDIR to a shorter one"):
        make_rpc_dir()
    with pytest.raises(EngineStartError, match="set TMPDIR to a shorter one"):
        asyncio.run(EngineProcess.start(launch(tmp_path)))  # serve's start error
    assert list(deep.iterdir()) == []


def test_directories_left_by_a_killed_serve_are_removed_at_the_next_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``kill -9`` of serve leaves is removed by the next serve; a directory a live
    process uses, or one just made (another serve starting an engine), stays."""
    with tempfile.TemporaryDirectory(prefix="t-") as short:
        monkeypatch.setattr(tempfile, "tempdir", short)
        base = Path(short)
        stale, live, fresh = (base / f"{RPC_DIR_PREFIX}{name}" for name in ("a", "b", "c"))
        for path in (stale, live, fresh):
            path.mkdir(mode=0o700)
        (base / f"{RPC_DIR_PREFIX}file").write_text("not a directory")
        hour_ago = time.time() - 3600
        for path in (stale, live):
            os.utime(path, (hour_ago, hour_ago))
        user = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            env={**os.environ, "VLLM_RPC_BASE_PATH": str(live)},
        )
        try:
            assert remove_stale_rpc_dirs() == [stale]
        finally:
            user.kill()
            user.wait()
        assert not stale.exists() and live.is_dir() and fresh.is_dir()
        assert (base / f"{RPC_DIR_PREFIX}file").is_file()
        assert remove_stale_rpc_dirs() == [live]  # its process is gone now


# What torch does on an engine's first compile (vLLM's first request with logprobs): write a
# precompiled header under its default cache directory (its name, from torch, in argv[2]),
# which it puts in the temporary directory whatever TORCHINDUCTOR_CACHE_DIR says.
PCH_ENGINE = """
import os, sys, tempfile
headers = os.path.join(tempfile.gettempdir(), sys.argv[2], "precompiled_headers")
os.makedirs(headers, exist_ok=True)
open(os.path.join(headers, sys.argv[1]), "w").close()
print(os.environ["TORCHINDUCTOR_CACHE_DIR"], flush=True)
"""


def test_torchs_precompiled_headers_outlive_the_engines_private_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's temporary directory is its own, but torch's cache in it is the one in the
    temporary directory serve was given: what one start compiled, the next reuses. Until
    torch made that directory (or when it is not this user's own), a start compiles in its
    private directory, as it did before."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    async def start(header: str) -> str:
        """One engine start that writes ``header``; its TORCHINDUCTOR_CACHE_DIR."""
        argv = (sys.executable, "-c", PCH_ENGINE, header, Path(default_cache_dir()).name)
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        engine = await EngineProcess.start(EngineLaunch("m", argv, env, 1, tmp_path / "m.log"))
        assert await engine.proc.wait() == 0, engine.log_tail()
        rpc = engine.rpc_dir
        engine.kill()
        assert not rpc.exists()  # the link went with the engine's directory
        return (tmp_path / "m.log").read_text().split()[-1]

    with tempfile.TemporaryDirectory(prefix="t-") as short:
        monkeypatch.setattr(tempfile, "tempdir", short)
        shared = Path(default_cache_dir())
        assert shared.parent == Path(short)
        asyncio.run(start("first.h.gch"))  # nothing to share yet: compiled in its own
        assert not (shared / "precompiled_headers").exists()
        # Torch makes it on its first use (serve points TORCHINDUCTOR_CACHE_DIR there).
        shared.mkdir(exist_ok=True)
        cache_dir = asyncio.run(start("second.h.gch"))
        assert cache_dir == str(shared)  # TORCHINDUCTOR_CACHE_DIR: where it was as well
        asyncio.run(start("third.h.gch"))
        assert sorted(os.listdir(shared / "precompiled_headers")) == [
            "second.h.gch",
            "third.h.gch",
        ]
        os.rename(shared, Path(short) / "elsewhere")
        shared.symlink_to(Path(short) / "elsewhere")  # not a directory of its own: not linked
        asyncio.run(start("fourth.h.gch"))
        assert "fourth.h.gch" not in os.listdir(Path(short) / "elsewhere" / "precompiled_headers")


# What vLLM's processes map in /dev/shm: the CPU TP communicator's segment and a broadcast
# queue (left behind), and a file that is not vLLM's own (a ledger: never touched).
SHM_ENGINE = """
import mmap, os, sys, time
maps = []
for name in sys.argv[1:]:
    fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
open(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "ready"), "w").close()
time.sleep(3600)
"""


def test_vllms_private_shared_memory_is_removed_with_the_engine(tmp_path: Path) -> None:
    tag = f"{os.getpid():x}{time.monotonic_ns():x}"
    private = [f"vllm_dist_{tag}-tp:0-[0-1]-cpushm_0", f"psm_{tag}"]
    other = f"elastickv-test-{tag}"
    names = [*private, other]
    argv = (sys.executable, "-c", SHM_ENGINE, *names)
    engine_launch = EngineLaunch("m", argv, dict(os.environ), 1, tmp_path / "m.log")

    async def scenario() -> None:
        engine = await EngineProcess.start(engine_launch)
        try:
            deadline = time.monotonic() + 20
            while not (engine.rpc_dir / "ready").exists():
                assert time.monotonic() < deadline and not engine.exited
                await asyncio.sleep(0.05)
            engine.note_shared_memory()
            assert engine.shared_memory == {SHM_DIR / name for name in private}
        finally:
            await engine.stop(timeout=5)

    try:
        asyncio.run(scenario())
        assert [name for name in names if (SHM_DIR / name).exists()] == [other]
    finally:
        for name in names:
            (SHM_DIR / name).unlink(missing_ok=True)


def test_private_shared_memory_names() -> None:
    for name in (
        "vllm_dist_9c171ea068534e21b780f94ed522f0d7-tp:0-[0-1]-cpushm_1",
        "43993-tp:0-[0-1]-cpushm_0",
        "psm_0ace815b",
        "sem.mp-36k5vnia",
    ):
        assert PRIVATE_SHM_NAME.fullmatch(name), name
    for name in ("elastickv-ledger-host", "psm_", "nixl_agent", "vllm_dist_9c17", "torch_123"):
        assert not PRIVATE_SHM_NAME.fullmatch(name), name


def test_a_stopped_engine_acts_on_its_sigterm(tmp_path: Path) -> None:
    """An engine stopped with SIGSTOP (a debugger, an operator, a test) is woken with its
    SIGTERM: it shuts down by its own handler, as vLLM's server does (exit status 0), instead
    of staying stopped until the SIGKILL that follows a stop's timeout."""
    program = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: os._exit(0))\n"
        "print('ready', flush=True)\n"
        "time.sleep(3600)\n"
    )
    log = tmp_path / "logs" / "m.log"
    argv = (sys.executable, "-c", program)

    async def scenario() -> None:
        engine = await EngineProcess.start(EngineLaunch("m", argv, dict(os.environ), 1, log))
        while "ready" not in (log.read_text() if log.exists() else ""):
            await asyncio.sleep(0.05)  # its handler is installed
        os.kill(engine.pid, signal.SIGSTOP)
        await engine.stop(timeout=20)
        assert engine.proc.returncode == 0  # its handler ran; not -SIGKILL
        assert not engine.processes()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("min_kv", "hinted"), [(str(64 << 10), True), (str(128 << 10), False), ("50%", False)]
)
def test_an_engine_refused_below_its_floor_names_serves_min_kv(
    tmp_path: Path, min_kv: str, hinted: bool
) -> None:
    """The plugin's refusal speaks of ELASTICKV_BUDGET, which serve sets from the model's
    ``min_kv``: serve's error names ``min_kv`` and the exact least it may be. At or above the
    floor the refusal had another cause (the device budget full): no such hint; nor for a
    budget that is not serve's bytes."""
    from aiohttp import ClientSession

    from elastickv.integrations.vllm.engine.floor import needs_at_least

    refusal = f"RuntimeError: the device budget is full; {needs_at_least(128 << 10)}: ..."
    program = f"import sys; print({refusal!r}, file=sys.stderr); sys.exit(1)"
    env = dict(os.environ, ELASTICKV_BUDGET=min_kv)
    started = EngineLaunch("chat", (sys.executable, "-c", program), env, 1, tmp_path / "m.log")

    async def scenario() -> str:
        engine = await EngineProcess.start(started)
        try:
            async with ClientSession() as session:
                with pytest.raises(EngineStartError) as refused:
                    await engine.wait_healthy(session, timeout=60)
        finally:
            await engine.stop(timeout=5)
        return str(refused.value)

    message = asyncio.run(scenario())
    hint = "its min_kv, 64K, is below the least it starts with, 128K"
    assert (hint in message) is hinted, message
    assert ('set min_kv = "128K" or more' in message) is hinted
    assert needs_at_least(128 << 10) in message  # the log's tail, as before
