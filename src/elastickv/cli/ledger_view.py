"""What the ledger commands share: the ``--device`` flag, turning ledger errors into one-line
user errors, and the JSON shape of instances and device usage (a public interface)."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from elastickv.cli.errors import UserError
from elastickv.control import DeviceUsage, InstanceInfo, Ledger, LedgerError, LedgerSnapshot
from elastickv.control.paths import ENV_DIR, HOST_DEVICE, ledger_path
from elastickv.units import format_bytes, parse_size

JSON_SCHEMA = 1


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default=HOST_DEVICE,
        help="ledger to use: 'host' (default), a GPU as 'cuda:N' or its key 'cuda-<GPU UUID>'",
    )


def device_key(text: str) -> str:
    """The ledger key of ``--device TEXT``: ``host`` and ``cuda-<UUID>`` as they are;
    ``cuda:N`` (the GPU vLLM and torch call ``cuda:N``, after ``CUDA_VISIBLE_DEVICES``) by
    asking the driver for its UUID (when the command runs, not when it is parsed)."""
    if not text.startswith("cuda:"):
        return text
    index = text.removeprefix("cuda:")
    if not index.isdigit():
        raise UserError(f"--device {text!r}: a GPU is cuda:N, N a device number")
    try:
        from elastickv.control import cuda_device_key
        from elastickv.vmm.cuda_driver import CudaDriver

        return cuda_device_key(CudaDriver(int(index)).uuid())
    except Exception as exc:
        raise UserError(
            f"cannot find the ledger of {text}: {exc}; give its key cuda-<GPU UUID> instead "
            "(nvidia-smi -L lists the UUIDs)"
        ) from None


def device_path(device: str) -> str:
    """The ledger file of ``device``, or a user error for a malformed device key."""
    try:
        return ledger_path(device)
    except ValueError as err:
        raise UserError(str(err)) from None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Ledger problems are the operator's to fix: report them as one line, not a traceback."""
    try:
        yield
    except (LedgerError, ValueError) as err:
        raise UserError(str(err)) from None


def ledger_exists(path: str) -> bool:
    """False for a missing file and for an empty one (what a reset of an unreadable ledger
    leaves, for the next instance to initialize)."""
    try:
        return os.lstat(path).st_size > 0
    except FileNotFoundError:
        return False


def no_ledger_message(device: str, path: str) -> str:
    return (
        f"no ledger for device {device!r} at {path}: no elastic instance has registered on this "
        f"device yet ({ENV_DIR} selects another ledger directory)"
    )


def open_existing(device: str) -> Ledger:
    """The device's ledger, never created: reading must not leave a ledger behind."""
    path = device_path(device)
    if not ledger_exists(path):
        raise UserError(no_ledger_message(device, path))
    with user_errors():
        return Ledger.open(device, create=False)


def parse_size_arg(text: str) -> int:
    """argparse type for sizes that keeps :func:`parse_size`'s explanation."""
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def limit_text(nbytes: int | None) -> str:
    return "none" if nbytes is None else format_bytes(nbytes)


def instance_dict(info: InstanceInfo) -> dict[str, Any]:
    """One instance as ``list --json`` prints it: the fields of :class:`InstanceInfo` plus its
    derived values, all byte counts in bytes."""
    return {
        "name": info.name,
        "pid": info.pid,
        "alive": info.alive,
        "slot": info.slot,
        "limit_desired": info.limit_desired,
        "limit_effective": info.limit_effective,
        "limit_revision": info.limit_revision,
        "committed_bytes": info.committed_bytes,
        "reserved_bytes": info.reserved_bytes,
        "used_bytes": info.used_bytes,
        "peak_bytes": info.peak_bytes,
        "over_limit_bytes": info.over_limit_bytes,
        "draining": info.draining,
        "admissions": info.admissions,
        "refusals": info.refusals,
        "releases": info.releases,
        "registered_at": info.registered_at,
        "floor_bytes": info.floor_bytes,
        "sleep_wanted": info.sleep_wanted,
        "asleep": info.asleep,
        "sleep_refused": info.sleep_refused,
    }


def usage_dict(usage: DeviceUsage) -> dict[str, Any]:
    return {
        "device": usage.device,
        "path": usage.path,
        "total_bytes": usage.total_bytes,
        "utilization": usage.utilization,
        "headroom_bytes": usage.headroom_bytes,
        "budget_bytes": usage.budget_bytes,
        "committed_bytes": usage.committed_bytes,
        "reserved_bytes": usage.reserved_bytes,
        "used_bytes": usage.used_bytes,
        "available_bytes": usage.available_bytes,
        "instances": usage.instances,
        "capacity": usage.capacity,
        "generation": usage.generation,
        "reclaimed": usage.reclaimed,
    }


def snapshot_dict(snap: LedgerSnapshot) -> dict[str, Any]:
    return {
        "schema": JSON_SCHEMA,
        "taken_at": snap.taken_at,
        "device": usage_dict(snap.usage),
        "instances": [instance_dict(info) for info in snap.instances],
    }
