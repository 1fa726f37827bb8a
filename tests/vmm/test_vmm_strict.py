"""Strict mode: a stray access to uncommitted memory kills the process with SIGSEGV.

Each case runs in a child interpreter, prints a marker after the accesses that must work,
then performs the stray access.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import elastickv.vmm

SRC = str(Path(elastickv.vmm.__file__).resolve().parents[2])

PRELUDE = """
import ctypes, sys
from elastickv.vmm import HostBackend
"""


def run_child(body: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def assert_segfault_after(result: subprocess.CompletedProcess[str], marker: str) -> None:
    assert marker in result.stdout, result.stderr
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr)


def test_stray_write_to_uncommitted_page_faults_while_committed_pages_work() -> None:
    result = run_child(
        """
        backend = HostBackend()
        page = backend.page_size
        vrange = backend.reserve(4 * page)
        vrange.commit([0, 1])
        tensor = vrange.as_tensor()
        tensor[: 2 * page].fill_(7)
        assert int(tensor[: 2 * page].sum()) == 7 * 2 * page
        print("COMMITTED-OK", flush=True)
        tensor[2 * page + 100] = 1
        print("NOT-REACHED", flush=True)
        """
    )
    assert_segfault_after(result, "COMMITTED-OK")
    assert "NOT-REACHED" not in result.stdout


def test_stray_read_of_uncommitted_page_faults_in_strict_mode() -> None:
    result = run_child(
        """
        backend = HostBackend()
        vrange = backend.reserve(2 * backend.page_size)
        vrange.commit([0])
        ctypes.memset(vrange.base_address, 1, 16)
        print("COMMITTED-OK", flush=True)
        print(ctypes.c_uint8.from_address(vrange.base_address + backend.page_size).value)
        """
    )
    assert_segfault_after(result, "COMMITTED-OK")


def test_released_page_faults() -> None:
    result = run_child(
        """
        backend = HostBackend()
        vrange = backend.reserve(2 * backend.page_size)
        vrange.commit([1])
        address = vrange.base_address + backend.page_size
        ctypes.memset(address, 1, 16)
        vrange.release([1])
        print("RELEASED", flush=True)
        ctypes.memset(address, 2, 16)
        """
    )
    assert_segfault_after(result, "RELEASED")


def test_non_strict_reads_zeros_but_a_write_still_faults() -> None:
    result = run_child(
        """
        backend = HostBackend(strict=False)
        vrange = backend.reserve(2 * backend.page_size)
        address = vrange.base_address + backend.page_size
        assert ctypes.c_uint8.from_address(address).value == 0
        print("READ-ZERO-OK", flush=True)
        ctypes.memset(address, 1, 16)
        """
    )
    assert_segfault_after(result, "READ-ZERO-OK")


def test_stale_tensor_after_close_faults_instead_of_aliasing() -> None:
    result = run_child(
        """
        backend = HostBackend()
        vrange = backend.reserve(2 * backend.page_size)
        vrange.commit([0])
        tensor = vrange.as_tensor()
        tensor[0] = 5
        vrange.close()
        print("CLOSED", flush=True)
        tensor[0] = 6
        """
    )
    assert_segfault_after(result, "CLOSED")


@pytest.mark.parametrize("strict", [True, False])
def test_child_exits_cleanly_without_stray_access(strict: bool) -> None:
    result = run_child(
        f"""
        backend = HostBackend(strict={strict})
        with backend.reserve(2 * backend.page_size) as vrange:
            vrange.commit([0, 1])
            ctypes.memset(vrange.base_address, 3, 2 * backend.page_size)
        print("DONE", flush=True)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "DONE" in result.stdout
