"""Every serve test gets its own ledger directory (never the user's /dev/shm ledger)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastickv.control import ENV_DIR


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "ledgers"
    monkeypatch.setenv(ENV_DIR, str(directory))
    return directory
