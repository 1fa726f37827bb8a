"""What a running ``elastickv serve`` publishes for ``elastickv list`` and ``top``.

A small JSON file per serve process, ``serve-<pid>.json`` in the ledger directory (owner-only,
replaced atomically): the router's address, the budget, and each model's state. Readers keep
only files whose process is still the one that wrote them (pid and start time) and delete the
others, so a ``kill -9``-ed serve leaves nothing that looks alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from elastickv.control.liveness import current_identity, process_start_time
from elastickv.control.paths import ledger_directory

SCHEMA = 1
PREFIX = "serve-"


def state_path(directory: str | None = None, pid: int | None = None) -> Path:
    return Path(directory or ledger_directory()) / f"{PREFIX}{pid or os.getpid()}.json"


def write_state(document: dict[str, Any], directory: str | None = None) -> Path:
    """Publish this process's serve state (atomically; mode 0600)."""
    me = current_identity()
    path = state_path(directory, me.pid)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = {"schema": SCHEMA, "pid": me.pid, "start_time": me.start_time, **document}
    fd, tmp = tempfile.mkstemp(prefix=".serve-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(body, out)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def remove_state(directory: str | None = None) -> None:
    with contextlib.suppress(OSError):
        state_path(directory).unlink()


def read_states(directory: str | None = None) -> list[dict[str, Any]]:
    """The live serve processes' states (stale files are removed)."""
    folder = Path(directory or ledger_directory())
    found: list[dict[str, Any]] = []
    for path in sorted(folder.glob(f"{PREFIX}*.json")) if folder.is_dir() else []:
        try:
            document = json.loads(path.read_text())
            alive = process_start_time(int(document["pid"])) == document["start_time"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if alive:
            found.append(document)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return found


def model_states(directory: str | None = None) -> dict[str, str]:
    """Served model name (= ledger instance name) → state, over every live serve."""
    return {
        model["name"]: model["state"]
        for document in read_states(directory)
        for model in document.get("models", [])
    }
