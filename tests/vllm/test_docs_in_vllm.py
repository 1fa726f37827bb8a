"""What the docs promise about a vLLM environment, checked inside one: the doc snippets
marked ``<!-- snippet: vllm -->`` run, and installing a clone of elastickv there adds
elastickv and nothing else (dry run: the environment is not changed)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DRY_RUN = (sys.executable, "-m", "pip", "install", "-q", "--dry-run")


def _load_doc_snippets() -> ModuleType:
    """tests/docs/doc_snippets.py (test folders are not packages)."""
    path = REPO / "tests" / "docs" / "doc_snippets.py"
    spec = importlib.util.spec_from_file_location("doc_snippets", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


doc_snippets = _load_doc_snippets()
VLLM_SNIPPETS: list[Any] = doc_snippets.python_snippets("vllm")


def test_the_docs_have_vllm_snippets() -> None:
    assert VLLM_SNIPPETS, "no <!-- snippet: vllm --> block found in README.md or docs/"


@pytest.mark.parametrize("snippet", VLLM_SNIPPETS, ids=[s.id for s in VLLM_SNIPPETS])
def test_vllm_snippet_runs(snippet: Any, tmp_path: Path) -> None:
    result = doc_snippets.run_python(snippet, tmp_path)
    assert result.returncode == 0, f"{snippet.id} failed:\n{result.stderr[-4000:]}"


def test_installing_a_clone_adds_only_elastickv(tmp_path: Path) -> None:
    clone = tmp_path / "elastickv"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, clone / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "src", clone / "src", ignore=ignore)
    result = subprocess.run(
        [*DRY_RUN, "--no-index", "--no-build-isolation", "--report", "-", str(clone)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    would_install = [item["metadata"]["name"] for item in report["install"]]
    assert would_install == ["elastickv"]
