"""What ``elastickv doctor`` checks, as plain dicts (the ``doctor --json`` interface).

Every probe catches its own failure and reports it as text: a doctor that crashes on the
problem it should describe is no use. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import stat
from typing import Any

from elastickv import __version__
from elastickv.cli.ledger_view import ledger_exists, usage_dict
from elastickv.cli.vllm_report import vllm_report
from elastickv.control import (
    RESET_COMMAND,
    Ledger,
    LedgerCorrupt,
    LedgerError,
    LedgerVersionMismatch,
)
from elastickv.control.paths import ENV_DIR, ledger_directory, ledger_path
from elastickv.vmm import DEFAULT_PAGE_SIZE, BackendUnavailable, HostBackend, VmmError


def host_backend() -> dict[str, Any]:
    try:
        backend = HostBackend()
    except BackendUnavailable as err:
        return {"available": False, "error": str(err)}
    return {
        "available": True,
        "granularity": backend.granularity,
        "page_size": backend.page_size,
        "strict": backend.strict,
        "error": None,
    }


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_backend(device: int = 0) -> dict[str, Any]:
    """Probes CUDA device ``device`` through the backend itself (bindings, driver, VMM)."""
    bindings = _distribution_version("cuda-bindings")
    report: dict[str, Any] = {
        "bindings_installed": bindings is not None,
        "bindings_version": bindings,
        "device": device,
        "available": False,
        "granularity": None,
        "page_size": None,
        "strict": False,
        "uncommitted": "zero",
        "total_bytes": None,
        "error": None,
    }
    if bindings is None:
        report["error"] = "cuda-bindings is not installed (pip install 'elastickv[cuda]')"
        return report
    from elastickv.vmm.cuda import CudaBackend

    try:
        backend = CudaBackend(device)
        report["total_bytes"] = backend.mem_get_info()[1]
    except (BackendUnavailable, VmmError, ImportError, OSError, RuntimeError) as err:
        report["error"] = str(err)
        return report
    report.update(
        available=True,
        granularity=backend.granularity,
        page_size=backend.page_size,
        strict=backend.strict,
        uncommitted=backend.uncommitted,
    )
    return report


def _directory_problem(directory: str) -> str | None:
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"cannot read ledger directory {directory}: {err.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"ledger directory {directory} is not a directory"
    if info.st_uid != os.geteuid():
        return (
            f"ledger directory {directory} belongs to uid {info.st_uid}, not to you "
            f"(uid {os.geteuid()}); remove it or set {ENV_DIR} to a directory you own"
        )
    return None


def ledger_report(device: str) -> dict[str, Any]:
    """Where the device's ledger lives and whether it opens and reads cleanly."""
    directory = ledger_directory()
    path = ledger_path(device, directory)
    report: dict[str, Any] = {
        "device": device,
        "directory": directory,
        "directory_from_env": bool(os.environ.get(ENV_DIR, "").strip()),
        "path": path,
        "exists": ledger_exists(path),
        "healthy": True,
        "error": None,
        "recovery": None,
        "usage": None,
    }
    problem = _directory_problem(directory)
    recovery = None
    if problem is None and report["exists"]:
        try:
            with Ledger.open(device, create=False) as ledger:
                report["usage"] = usage_dict(ledger.snapshot().usage)
        except LedgerError as err:
            problem = str(err)
            # Damage is what a reset repairs; other errors (ownership, modes) say their own fix.
            if isinstance(err, LedgerCorrupt | LedgerVersionMismatch):
                recovery = RESET_COMMAND
    if problem is not None:
        report.update(healthy=False, error=problem, recovery=recovery)
    return report


def diagnose(device: str) -> dict[str, Any]:
    host = host_backend()
    return {
        "schema": 1,
        "elastickv": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "default_page_size": DEFAULT_PAGE_SIZE,
        "strict_default": bool(host.get("strict", True)),
        "backends": {"host": host, "cuda": cuda_backend()},
        "ledger": ledger_report(device),
        "vllm": vllm_report(),
    }
