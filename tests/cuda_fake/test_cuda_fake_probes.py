"""The eight VMM probes on the CUDA backend, through the real bindings and the strict fake."""

from __future__ import annotations

import json

import pytest
from fakecuda_lib import CUDA_ERROR_ILLEGAL_ADDRESS, FakeCuda

from elastickv.probes.vmm_probe import CASES, main, run_case
from elastickv.vmm.cuda import CudaBackend


def test_all_eight_probes_pass_on_the_cuda_backend(
    fake: FakeCuda, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--backend", "cuda", "--json"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert {r["case"] for r in results} == {c.name for c in CASES}
    for r in results:
        assert r["ok"], r
        assert r["backend"] == "cuda"
        assert r["rejected_under_pressure"] and r["reallocated"]
        assert r["straddling_blocks"] > 0
    assert fake.sticky_error() == 0


def test_a_sticky_fault_is_a_fail_row_not_a_traceback(fake: FakeCuda) -> None:
    backend = CudaBackend()
    assert fake.launch(0, 1) == CUDA_ERROR_ILLEGAL_ADDRESS  # a stray kernel poisons the context
    result = run_case(backend, CASES[0])
    assert not result.ok
    assert result.error is not None and "CUDA_ERROR_ILLEGAL_ADDRESS" in result.error
    fake.reset()


def test_a_fault_during_the_case_still_closes_into_a_fail_row(fake: FakeCuda) -> None:
    backend = CudaBackend()
    fake.fail("cuMemUnmap", nth=1, code=CUDA_ERROR_ILLEGAL_ADDRESS)
    result = run_case(backend, CASES[1])
    assert not result.ok
    assert result.error is not None
    fake.reset()


def test_bad_page_size_is_an_error_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "cuda", "--page-size", "12345"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: page_size 12345 bytes is not a positive multiple")
