"""A damaged, truncated, foreign, wrong-version or other user's ledger is refused with an
error that names the file and the recovery command; reset recovers."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from ledger_cases import BUDGET

from elastickv.control import (
    RESET_COMMAND,
    InstanceClosed,
    Ledger,
    LedgerCorrupt,
    LedgerError,
    LedgerPermissionError,
    LedgerVersionMismatch,
    open_ledger,
    reset_ledger,
)
from elastickv.control.records import HEADER_SIZE, MAGIC, record_offset


def make_ledger(ledger_dir: Path) -> Path:
    with open_ledger(total_bytes=BUDGET) as led, led.register("a") as handle:
        assert handle.try_admit(1024)
    return ledger_dir / "host.ledger"


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def assert_refused(path: Path, error: type[LedgerError], match: str) -> None:
    with pytest.raises(error, match=match) as caught:
        open_ledger()
    assert str(path) in str(caught.value)
    if error is not LedgerPermissionError:
        assert RESET_COMMAND in str(caught.value)


def test_foreign_file_is_refused_then_reset(ledger_dir: Path) -> None:
    path = make_ledger(ledger_dir)
    patch(path, 0, b"NOTMINE!")
    assert_refused(path, LedgerCorrupt, "not an elastickv ledger")
    assert reset_ledger() == str(path)
    with open_ledger() as led:
        assert led.list_instances() == []
        assert led.register("a").try_admit(1)


def test_random_bytes_file_is_refused(ledger_dir: Path) -> None:
    ledger_dir.mkdir(mode=0o700)
    path = ledger_dir / "host.ledger"
    path.write_bytes(os.urandom(5000))
    path.chmod(0o600)
    assert_refused(path, LedgerCorrupt, "not an elastickv ledger")
    Ledger.reset(str(path))
    with open_ledger() as led:
        assert led.device_usage().capacity == 64


def test_wrong_version_is_refused(ledger_dir: Path) -> None:
    path = make_ledger(ledger_dir)
    patch(path, len(MAGIC), struct.pack("<I", 99))
    assert_refused(path, LedgerVersionMismatch, "format version 99")


def test_truncated_file_is_refused(ledger_dir: Path) -> None:
    path = make_ledger(ledger_dir)
    os.truncate(path, HEADER_SIZE + 10)
    assert_refused(path, LedgerCorrupt, "truncated")
    os.truncate(path, 20)
    assert_refused(path, LedgerCorrupt, "truncated")


def test_damaged_header_is_refused(ledger_dir: Path) -> None:
    path = make_ledger(ledger_dir)
    patch(path, 100, b"\xff\xff")  # inside the budget fields
    assert_refused(path, LedgerCorrupt, "checksum")


def test_damaged_record_is_reported_not_trusted(ledger_dir: Path) -> None:
    with open_ledger(total_bytes=BUDGET) as led:
        handle = led.register("a")
        assert handle.try_admit(4096)
        path = Path(led.path)
        patch(path, record_offset(0) + 60, b"\x7f")  # committed bytes scribbled
        with pytest.raises(LedgerCorrupt, match="record 0"):
            led.list_instances()
        with pytest.raises(LedgerCorrupt, match="record 0"):
            handle.try_admit(1)


def test_truncation_under_a_running_ledger_is_an_error_not_sigbus(ledger_dir: Path) -> None:
    with open_ledger(total_bytes=BUDGET) as led:
        handle = led.register("a")
        os.truncate(led.path, HEADER_SIZE)
        with pytest.raises(LedgerCorrupt, match="resized"):
            handle.try_admit(1)


def test_reset_under_running_instances_closes_their_handles(ledger_dir: Path) -> None:
    with open_ledger(total_bytes=BUDGET) as led:
        handle = led.register("a")
        assert handle.try_admit(4096)
        Ledger.reset(led.path)
        with pytest.raises(InstanceClosed, match="register again"):
            handle.try_admit(1)
        handle.release(4096)  # nothing to give back any more: not an error
        assert led.list_instances() == []
        assert led.device_usage().budget_bytes == int(BUDGET * 0.9)  # budget kept


def test_ledger_of_another_user_is_refused(ledger_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the ledger to another user")
    path = make_ledger(ledger_dir)
    os.chown(path, 65534, 65534)
    assert_refused(path, LedgerPermissionError, "belongs to uid 65534")
    with pytest.raises(LedgerPermissionError, match="refusing to reset"):
        Ledger.reset(str(path))
    os.chown(path, 0, 0)
    os.chown(ledger_dir, 65534, 65534)
    with pytest.raises(LedgerPermissionError, match="directory"):
        open_ledger()


def test_open_to_others_or_symlinked_ledger_is_refused(ledger_dir: Path, tmp_path: Path) -> None:
    path = make_ledger(ledger_dir)
    path.chmod(0o644)
    assert_refused(path, LedgerPermissionError, "chmod 600")
    path.chmod(0o600)
    target = tmp_path / "elsewhere.ledger"
    path.rename(target)
    path.symlink_to(target)
    assert_refused(path, LedgerPermissionError, "regular file")


def test_missing_ledger_without_create(ledger_dir: Path) -> None:
    with pytest.raises(LedgerError, match="no ledger"):
        open_ledger(create=False)
