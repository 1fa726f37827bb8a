"""benchmarks/gpu_check.py's checks that need no CUDA kernel, against the fake driver.

Tensors over the fake's device memory are host tensors, so the store and attention checks run
their torch code on the CPU; the ledger check's two worker processes load the fake through
``LD_PRELOAD`` (the bindings then find it by its soname, as in this process). What needs a real
kernel (a stray read or write on a GPU) runs only in ``make gpu-check``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from fakecuda_lib import FakeCuda

from elastickv.vmm.cuda_driver import CudaDriver

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


gpu_check = load_script()
CASES = {case.name: case for case in gpu_check.layout_cases()}


@pytest.fixture
def target(tmp_path: Path) -> Any:
    return gpu_check.Target(torch.device("cpu"), tmp_path)


def test_the_probes_row(fake: FakeCuda) -> None:
    check = gpu_check.check_probes()
    assert check.ok, check.detail
    assert check.numbers["cases"] == 8 and check.numbers["failed"] == 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_store_rows(fake: FakeCuda, target: Any, name: str) -> None:
    check = gpu_check.check_store(target, CASES[name])
    assert check.ok, check.detail
    assert check.numbers["bit_exact"] and check.numbers["never_written_zero"]
    assert check.numbers["blocks_on_uncommitted_pages"] > 0, "the zero page was read"
    assert check.numbers["recommitted_zero"]


def test_the_store_row_fails_when_pages_are_not_zeroed(
    monkeypatch: pytest.MonkeyPatch, fake: FakeCuda, target: Any
) -> None:
    """The check can fail: with the zero page left unzeroed (the first zeroing of the range is
    its), it holds the fake's stale 0xFF bytes and blocks on uncommitted pages do not read 0."""
    real_zero = CudaDriver.zero
    calls = 0

    def all_but_the_first(self: CudaDriver, address: int, size: int, stream: int | None) -> None:
        nonlocal calls
        calls += 1
        if calls > 1:
            real_zero(self, address, size, stream)

    monkeypatch.setattr(CudaDriver, "zero", all_but_the_first)
    check = gpu_check.check_store(target, CASES["flash-attn NHD"])
    assert not check.ok
    assert "NOT 0" in check.detail


@pytest.mark.parametrize("name", ["flash-attn NHD", "flashinfer HND"])
def test_the_attention_rows(fake: FakeCuda, target: Any, name: str) -> None:
    check = gpu_check.check_attention(target, CASES[name])
    assert check.ok, check.detail
    assert check.numbers["gathered_exact"]
    assert check.numbers["blockwise_max_abs_error"] <= gpu_check.ATTENTION_TOLERANCE


def test_the_commit_release_row_produces_numbers(fake: FakeCuda) -> None:
    check = gpu_check.check_commit_release(pages=8)
    assert check.ok, check.detail
    for name in ("raw_map_us", "zero_commit_us", "fault_release_us", "zero_commit_ratio"):
        value = check.numbers[name]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, name
    assert set(gpu_check.A100_ANCHOR_US) == {"create", "map", "set_access", "unmap"}
    assert "raw_unmap_vs_a100" in check.numbers


def test_the_ledger_row_with_two_processes(
    monkeypatch: pytest.MonkeyPatch, fake: FakeCuda, target: Any
) -> None:
    monkeypatch.setenv("LD_PRELOAD", str(fake.path))
    check = gpu_check.check_ledger(target, churn_seconds=0.5)
    assert check.ok, check.detail
    numbers = check.numbers
    assert numbers["device_key"].startswith("cuda-gpu-")
    assert numbers["first_pages"] == gpu_check.LEDGER_WANT_PAGES
    assert numbers["second_pages"] < gpu_check.LEDGER_WANT_PAGES
    assert numbers["peak_committed_bytes"] <= numbers["budget_bytes"]
    assert numbers["committed_after_bytes"] == 0


def test_a_failing_check_is_a_fail_row() -> None:
    def broken() -> Any:
        raise RuntimeError("no device")

    check = gpu_check.guarded("probes", broken)
    assert not check.ok and check.detail == "RuntimeError: no device"


def test_without_kernels_the_gpu_only_rows_are_left_out(
    monkeypatch: pytest.MonkeyPatch, target: Any
) -> None:
    ran: list[str] = []

    def record(name: str) -> Any:
        def check(*_: Any) -> Any:
            ran.append(name)
            return gpu_check.Check(name, True, "")

        return check

    for function in (
        "check_probes",
        "check_store",
        "check_attention",
        "check_commit_release",
        "check_ledger",
        "check_uncommitted_read",
        "check_worker_protocol",
        "check_uncommitted_write",
    ):
        monkeypatch.setattr(gpu_check, function, record(function))
    assert len(gpu_check.run_checks(target, kernels=False)) == 1 + 3 + 2 + 1 + 1
    assert not {"check_uncommitted_read", "check_worker_protocol", "check_uncommitted_write"} & set(
        ran
    )
    assert ran.count("check_store") == 3 and ran.count("check_attention") == 2
    ran.clear()
    gpu_check.run_checks(target, kernels=True)
    assert ran[-3:] == [
        "check_uncommitted_read",
        "check_worker_protocol",
        "check_uncommitted_write",
    ]
