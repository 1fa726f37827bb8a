"""What ``elastickv list`` and ``top`` show of a running ``elastickv serve``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from elastickv.control import open_ledger
from elastickv.serve.state_file import model_states, read_states, state_path, write_state

DOC = {
    "url": "http://127.0.0.1:8080",
    "budget_bytes": 64 << 20,
    "models": [
        {
            "name": "chat-model-with-a-long-name", "state": "kv-released",
            "committed_bytes": 1 << 20, "limit_bytes": 1 << 20, "min_kv": 4 << 20,
            "cap": 32 << 20, "in_flight": 0, "waiting": 0,
        },
        {
            "name": "other", "state": "stopped", "committed_bytes": None, "limit_bytes": None,
            "min_kv": 4 << 20, "cap": 32 << 20, "in_flight": 0, "waiting": 2,
        },
    ],
}  # fmt: skip


def test_written_owner_only_and_read_back(ledger_dir: Path) -> None:
    path = write_state(DOC)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    (doc,) = read_states()
    assert doc["pid"] == os.getpid() and doc["models"] == DOC["models"]
    assert model_states() == {"chat-model-with-a-long-name": "kv-released", "other": "stopped"}


def test_a_dead_serves_file_is_ignored_and_removed(ledger_dir: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(dead.stdout)
    path = state_path(str(ledger_dir), pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "start_time": 1, **DOC}))
    assert read_states() == []
    assert not path.exists()


def test_list_shows_served_models_and_their_state(ledger_dir: Path) -> None:
    write_state(DOC)
    with open_ledger("host") as ledger, ledger.register("chat-model-with-a-long-name"):
        env = dict(os.environ, COLUMNS="80")
        text = subprocess.run(
            [sys.executable, "-m", "elastickv.cli.main", "list"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        as_json = json.loads(
            subprocess.run(
                [sys.executable, "-m", "elastickv.cli.main", "list", "--json"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
    assert "elastickv serve (pid" in text and "http://127.0.0.1:8080/v1" in text
    assert "kv-released" in text and "stopped" in text
    assert as_json["serve"][0]["models"][1]["state"] == "stopped"
