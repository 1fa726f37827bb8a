"""What a vLLM engine leaves behind when it stops or dies, and how serve keeps it contained:
its IPC sockets and temporary files (a private directory per engine start) and its private
shared memory in ``/dev/shm``. :class:`~elastickv.serve.engine.EngineProcess` removes both
(:func:`remove_leftovers`) once the engine's processes are gone; :func:`remove_stale_rpc_dirs`
removes what a serve killed with ``-9`` left.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

# vLLM's processes talk over ZeroMQ IPC sockets that it creates in ``VLLM_RPC_BASE_PATH`` (by
# default the system's temporary directory) and leaves there when it stops: seven per start of
# a 0.32 server, so a serve that stops and wakes its engines would leave thousands in /tmp.
# Each engine start gets a directory of its own (owner-only), removed once the engine is gone.
RPC_DIR_PREFIX = "elastickv-rpc-"
# A unix socket's path holds at most 107 bytes, and vLLM adds "/" and a 36-character uuid.
MAX_RPC_DIR_BYTES = 107 - 37
# A directory younger than this is never taken for stale: it may belong to an engine that
# another serve is starting now (made, its process not yet begun).
STALE_RPC_DIR_AGE_S = 60.0
# vLLM's shared-memory files that belong to one engine alone: its processes map them, and
# vLLM leaves some behind: the CPU tensor-parallel communicator's two segments (4 MB each) on
# every stop, its broadcast queues and Python's semaphores when it dies. serve notes them
# once the engine is healthy and removes them once it is gone. Nothing else (the ledger, a
# connector's segments) matches.
SHM_DIR = Path("/dev/shm")
PRIVATE_SHM_NAME = re.compile(r".+-cpushm_[0-9]+|psm_[0-9a-f]+|sem\.mp-\w+")


def make_rpc_dir() -> Path:
    """A new owner-only directory for one engine's IPC sockets and temporary files (see
    ``RPC_DIR_PREFIX`` and :func:`private_temp_env`), torch's cache linked into it; ValueError
    if ``TMPDIR`` is too long for a socket path in it."""
    path = Path(tempfile.mkdtemp(prefix=RPC_DIR_PREFIX))
    if len(os.fsencode(path)) > MAX_RPC_DIR_BYTES:
        path.rmdir()
        raise ValueError(
            f"the temporary directory {path.parent} is too long a path for an engine's IPC "
            f"sockets (a unix socket path holds 107 bytes); set TMPDIR to a shorter one"
        )
    _link_torch_temp_cache(path, _torch_temp_cache())
    return path


def private_temp_env(env: Mapping[str, str], private_dir: Path) -> dict[str, str]:
    """``env`` for an engine whose temporary files go to ``private_dir`` (removed with it):
    its IPC sockets (``VLLM_RPC_BASE_PATH``) and everything its processes put in the
    temporary directory (``TMPDIR``), such as torch.distributed's ``vllm_dist_*`` rendezvous
    file, one per start, that vLLM never removes. torch's compile caches stay where they
    were, so a woken engine reuses them: ``TORCHINDUCTOR_CACHE_DIR``, and the precompiled
    headers torch keeps under the temporary directory whatever that variable says (linked
    from ``private_dir`` by :func:`make_rpc_dir`; without the link every start compiled one
    again: 150 MB, and its first request with logprobs waited about 5 s for it)."""
    if not env.get("TORCHINDUCTOR_CACHE_DIR"):
        env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(_torch_temp_cache())}
    return {**env, "VLLM_RPC_BASE_PATH": str(private_dir), "TMPDIR": str(private_dir)}


def _torch_temp_cache() -> Path:
    """torch's own cache directory in the temporary directory: ``torchinductor_<user>``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}"


def _link_torch_temp_cache(private_dir: Path, shared: Path) -> None:
    """Link ``private_dir/<shared's name>`` to ``shared`` once torch made it (its first
    compile does); only a directory of this user's, never another's nor a link: else torch
    compiles in ``private_dir`` as before."""
    with contextlib.suppress(OSError):
        info = shared.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            (private_dir / shared.name).symlink_to(shared, target_is_directory=True)


def remove_stale_rpc_dirs() -> list[Path]:
    """Remove this user's engine IPC directories that no live process uses: what the engines
    of a serve killed with ``-9`` left (serve could not remove them). A directory is in use
    while a process of this user has it as ``VLLM_RPC_BASE_PATH``; one changed in the last
    ``STALE_RPC_DIR_AGE_S`` is kept. Returns the directories removed."""
    now = time.time()
    uid = os.getuid()
    candidates = []
    for path in Path(tempfile.gettempdir()).glob(f"{RPC_DIR_PREFIX}*"):
        with contextlib.suppress(OSError):
            info = path.lstat()
            old = now - info.st_mtime >= STALE_RPC_DIR_AGE_S
            if stat.S_ISDIR(info.st_mode) and info.st_uid == uid and old:
                candidates.append(path)
    if not candidates:
        return []
    in_use = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.uids().real == uid:
                used = proc.environ().get("VLLM_RPC_BASE_PATH")
                if used:
                    in_use.add(os.path.realpath(used))
    removed = [path for path in candidates if os.path.realpath(path) not in in_use]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def private_shared_memory(pids: Iterable[int]) -> set[Path]:
    """The files of ``SHM_DIR`` that processes ``pids`` map and whose names are vLLM's
    private ones (``PRIVATE_SHM_NAME``). Reads ``/proc/<pid>/maps`` (1.4 ms for a process
    that imported vLLM's server, against 34 ms for psutil's ``memory_maps``, which parses
    ``smaps``)."""
    found = set()
    marker = f" {SHM_DIR}/".encode()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as maps:
                data = maps.read()
        except OSError:
            continue
        if marker not in data:
            continue
        for line in data.splitlines():
            at = line.find(marker)
            if at >= 0:
                path = Path(os.fsdecode(line[at + 1 :]))  # an unlinked file ends " (deleted)"
                if path.parent == SHM_DIR and PRIVATE_SHM_NAME.fullmatch(path.name):
                    found.add(path)
    return found


def remove_leftovers(rpc_dir: Path, shared_memory: Iterable[Path] = ()) -> None:
    """Remove what an engine left once it is gone: its IPC directory and those of its
    private shared-memory files (:func:`private_shared_memory`) still there and this user's."""
    shutil.rmtree(rpc_dir, ignore_errors=True)
    uid = os.getuid()
    for path in shared_memory:
        with contextlib.suppress(OSError):
            if path.lstat().st_uid == uid:
                path.unlink()
