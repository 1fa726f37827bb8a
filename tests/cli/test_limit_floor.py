"""``elastickv limit NAME SIZE`` below what the instance holds for its whole life is refused
with the minimum (before, ``limit NAME 1M`` was accepted and the instance stayed "draining"
forever)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastickv.control import ENV_DIR, open_ledger

SCRIPT = Path(sys.executable).with_name("elastickv")
MiB = 1 << 20


def test_limit_below_the_floor_is_refused_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "ledgers"))
    with open_ledger(total_bytes=64 * MiB, utilization=1.0) as ledger:
        handle = ledger.register("tiny-llama:8000")
        handle.set_floor_bytes(2 * MiB)
        assert handle.try_admit(2 * MiB)
        refused = subprocess.run(
            [str(SCRIPT), "limit", "tiny-llama:8000", "1M"], capture_output=True, text=True
        )
        assert refused.returncode != 0
        assert "below the floor of instance 'tiny-llama:8000'" in refused.stderr
        assert "set at least 2M" in refused.stderr  # exact, as the user types it
        assert handle.info().limit_desired is None  # unchanged
        accepted = subprocess.run(
            [str(SCRIPT), "limit", "tiny-llama:8000", "2M"], capture_output=True, text=True
        )
        assert accepted.returncode == 0, accepted.stderr
        assert handle.info().limit_desired == 2 * MiB
        handle.close()
