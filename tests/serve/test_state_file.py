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


def run_list(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "elastickv.cli.main", "list", *args],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def test_list_shows_one_reading_of_the_ledger_in_both_tables(ledger_dir: Path) -> None:
    """The serve table showed the bytes serve's file had (``USED 2.0 MiB LIMIT 16.5 MiB``)
    next to the ledger's own (``LIMIT 6.4 MiB COMMITTED 6.4 MiB``): now both come from the
    one snapshot ``list`` takes, and a model above a lowered limit is draining in both."""
    write_state(DOC)  # says 1 MiB used, 1 MiB limit
    name = "chat-model-with-a-long-name"
    with open_ledger("host") as ledger, ledger.register(name, limit=4 << 20) as handle:
        assert handle.try_admit(3 << 20)
        ledger.set_limit(name, 2 << 20)  # a release lowered it: 1 MiB to drain
        listing = json.loads(run_list("--json"))
        text = run_list()
    (record,) = listing["instances"]
    model = listing["serve"][0]["models"][0]
    assert (model["committed_bytes"], model["limit_bytes"]) == (3 << 20, 2 << 20)
    assert (record["used_bytes"], record["limit_desired"]) == (3 << 20, 2 << 20)
    assert model["over_limit_bytes"] == record["over_limit_bytes"] == 1 << 20
    assert listing["serve"][0]["models"][1]["committed_bytes"] is None  # stopped: no record
    instance_row, served_row = (line for line in text.splitlines() if line.startswith(name))
    assert "3.0 MiB" in instance_row and "kv-released, draining 1.0 MiB" in instance_row
    assert served_row.split()[1:5] == ["kv-released,", "draining", "1.0", "MiB"]
    assert "3.0 MiB" in served_row and "2.0 MiB" in served_row and "1.0 MiB" in served_row
