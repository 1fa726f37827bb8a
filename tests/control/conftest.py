"""Every test gets its own ledger directory, so nothing touches the real /dev/shm ledger."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ledger_cases import BUDGET

from elastickv.control import ENV_DIR, Ledger, open_ledger


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "ledgers"
    monkeypatch.setenv(ENV_DIR, str(directory))
    return directory


@pytest.fixture
def ledger(ledger_dir: Path) -> Iterator[Ledger]:
    with open_ledger(total_bytes=BUDGET, utilization=1.0) as opened:
        yield opened
