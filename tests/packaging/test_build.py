"""``python -m build`` makes an sdist and a wheel that hold the whole package, and the wheel
installs on its own (``pip install --no-deps``) and runs ``elastickv --help``.

The build runs without network (``--no-isolation``: the project venv's setuptools) on a copy
of what the sdist needs, so the checkout is left untouched; build makes the wheel from the
sdist, which proves the sdist holds everything the wheel is built from.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastickv import __version__

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "elastickv"
PIP_INSTALL = (sys.executable, "-m", "pip", "install", "-q")
ENTRY_POINTS = {
    "console_scripts": {"elastickv": "elastickv.cli.main:main"},
    "vllm.general_plugins": {"elastickv": "elastickv.integrations.vllm.plugin:register"},
}


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path


def package_files() -> set[str]:
    """Every file of the package as ``elastickv/...``: modules and ``py.typed``."""
    return {
        path.relative_to(PACKAGE.parent).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dist]:
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "src", tree / "src", ignore=ignore)
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, f"python -m build failed:\n{build.stdout}\n{build.stderr}"
    sdists, wheels = list(out.glob("*.tar.gz")), list(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in out.iterdir())
    yield Dist(sdist=sdists[0], wheel=wheels[0])


def test_the_wheel_holds_every_package_and_py_typed(dist: Dist) -> None:
    assert dist.wheel.name == f"elastickv-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = set(wheel.namelist())
    packaged = {name for name in names if name.startswith("elastickv/")}
    assert packaged == package_files()
    subpackages = {p.parent.name for p in PACKAGE.rglob("__init__.py")}
    assert {"alloc", "cli", "control", "geometry", "integrations", "serve", "vmm"} <= subpackages
    assert "elastickv/py.typed" in names


def test_the_wheel_declares_the_script_and_the_vllm_plugin(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as wheel:
        text = wheel.read(f"elastickv-{__version__}.dist-info/entry_points.txt").decode()
    parser = configparser.ConfigParser()
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    declared = {group: dict(parser[group]) for group in parser.sections()}
    assert declared == ENTRY_POINTS


def test_the_sdist_holds_what_builds_the_wheel(dist: Dist) -> None:
    root = f"elastickv-{__version__}/"
    with tarfile.open(dist.sdist) as sdist:
        names = {name.removeprefix(root) for name in sdist.getnames()}
    assert {"pyproject.toml", "README.md", "PKG-INFO"} <= names
    assert {f"src/{name}" for name in package_files()} <= names


def test_the_wheel_installs_alone_and_runs(dist: Dist, tmp_path: Path) -> None:
    target = tmp_path / "site"
    install = subprocess.run(
        [*PIP_INSTALL, "--no-deps", "--no-index", "--target", str(target), str(dist.wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert install.returncode == 0, install.stderr
    # Only elastickv went in: --no-deps, and nothing else is bundled.
    assert {p.name for p in target.iterdir()} == {
        "bin", "elastickv", f"elastickv-{__version__}.dist-info",
    }  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import elastickv; print(elastickv.__file__)"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(target)
    run = subprocess.run(
        [str(target / "bin" / "elastickv"), "--help"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    for command in ("list", "limit", "top", "doctor", "serve", "layout"):
        assert command in run.stdout
