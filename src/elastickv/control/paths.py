"""Where ledgers live. The one place that reads ``ELASTICKV_LEDGER_DIR``.

Default: ``/dev/shm/elastickv-<uid>/`` (a tmpfs, so the ledger is shared memory and vanishes
at reboot, when no instance can be running anyway), one file per device: ``host.ledger`` for
host memory, ``cuda-<GPU UUID>.ledger`` per GPU. The directory is per user and 0700, so
another user can neither read nor pre-create (squat) it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from elastickv.control.errors import LedgerPermissionError
from elastickv.control.records import validate_device_key

DEFAULT_ROOT = "/dev/shm"
ENV_DIR = "ELASTICKV_LEDGER_DIR"
HOST_DEVICE = "host"


def cuda_device_key(uuid: str) -> str:
    """``GPU-8f3a…`` (as nvidia-smi or cuDeviceGetUuid print it) → ``cuda-gpu-8f3a…``."""
    return validate_device_key("cuda-" + uuid.strip().lower())


def ledger_directory(env: Mapping[str, str] | None = None) -> str:
    environ = os.environ if env is None else env
    override = environ.get(ENV_DIR, "").strip()
    if override:
        return override
    return os.path.join(DEFAULT_ROOT, f"elastickv-{os.geteuid()}")


def ledger_path(device: str = HOST_DEVICE, directory: str | None = None) -> str:
    key = validate_device_key(device)
    return os.path.join(directory or ledger_directory(), f"{key}.ledger")


def ensure_directory(directory: str) -> None:
    """Create the directory 0700; refuse one owned by another user."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise LedgerPermissionError(
            f"cannot create ledger directory {directory}: {exc.strerror}; set {ENV_DIR} to a "
            "directory you own"
        ) from exc
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise LedgerPermissionError(f"ledger directory {directory} is not a directory")
    if info.st_uid != os.geteuid():
        raise LedgerPermissionError(
            f"ledger directory {directory} belongs to uid {info.st_uid}, not to you "
            f"(uid {os.geteuid()}); remove it or set {ENV_DIR} to a directory you own"
        )
