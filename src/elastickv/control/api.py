"""One-call helpers over :class:`Ledger` for tools that do not keep a ledger open (the CLI,
scripts): each opens the device's existing ledger, does one thing, and closes it."""

from __future__ import annotations

from collections.abc import Generator

from elastickv.control.info import DeviceUsage, InstanceInfo, LedgerSnapshot
from elastickv.control.ledger import LimitSpec, open_ledger
from elastickv.control.paths import HOST_DEVICE


def list_instances(
    device: str = HOST_DEVICE, *, directory: str | None = None
) -> list[InstanceInfo]:
    """Live instances on ``device`` (dead ones are reclaimed first)."""
    with open_ledger(device, directory=directory, create=False) as ledger:
        return ledger.list_instances()


def device_usage(device: str = HOST_DEVICE, *, directory: str | None = None) -> DeviceUsage:
    with open_ledger(device, directory=directory, create=False) as ledger:
        return ledger.device_usage()


def snapshot(device: str = HOST_DEVICE, *, directory: str | None = None) -> LedgerSnapshot:
    with open_ledger(device, directory=directory, create=False) as ledger:
        return ledger.snapshot()


def set_limit(
    name: str,
    limit: LimitSpec,
    *,
    expected_revision: int | None = None,
    device: str = HOST_DEVICE,
    directory: str | None = None,
) -> int:
    """Set an instance's limit by name; returns the new revision (see ``Ledger.set_limit``)."""
    with open_ledger(device, directory=directory, create=False) as ledger:
        return ledger.set_limit(name, limit, expected_revision=expected_revision)


def watch(
    interval: float = 1.0,
    *,
    changes_only: bool = False,
    device: str = HOST_DEVICE,
    directory: str | None = None,
) -> Generator[LedgerSnapshot, None, None]:
    """Snapshots every ``interval`` seconds until the iterator is closed."""
    with open_ledger(device, directory=directory, create=False) as ledger:
        yield from ledger.watch(interval, changes_only=changes_only)


def reset_ledger(device: str = HOST_DEVICE, *, directory: str | None = None) -> str:
    """Recreate the device's ledger in place (``elastickv doctor --reset-ledger``); returns
    its path."""
    from elastickv.control.ledger import Ledger
    from elastickv.control.paths import ledger_path

    path = ledger_path(device, directory)
    Ledger.reset(path)
    return path
