"""The eight VMM probes run green on the host backend through the module's real entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastickv.probes.vmm_probe import CASES, ProbeCase


def run_probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastickv.probes.vmm_probe", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_all_eight_cases_pass_on_the_host_backend() -> None:
    done = run_probe("--backend", "host", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert len(results) == 8
    assert {r["case"] for r in results} == {c.name for c in CASES}
    for r in results:
        assert r["ok"], r
        assert r["backend"] == "host"
        assert r["straddling_blocks"] > 0, "blocks must cross page boundaries"
        assert r["rejected_under_pressure"] and r["reallocated"]
        assert r["footprint_after_free"] < r["peak_footprint"]
    layouts = {r["layout"] for r in results}
    assert layouts == {"LBNHC", "LBHNC", "BLNHC", "BHLNC"}


def test_table_output_and_small_pages() -> None:
    done = run_probe("--backend", "host", "--page-size", str(64 * 1024))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASS") == 8


def test_cases_cover_the_matrix() -> None:
    assert len(set(CASES)) == 8
    cross = ProbeCase("cross-layer", "HND", 2).geometry()
    assert cross.kernel_ratio == 2 and cross.num_layers == 3 and cross.num_blocks == 601


def test_cuda_backend_fails_clearly_without_a_gpu() -> None:
    from elastickv.probes.vmm_probe import make_backend
    from elastickv.vmm import BackendUnavailable

    try:
        make_backend("cuda", None)
    except BackendUnavailable:
        pass
    else:
        pytest.skip("a CUDA device is available here")
    done = run_probe("--backend", "cuda")
    assert done.returncode == 2
    assert "error:" in done.stderr and "CUDA" in done.stderr


def test_bad_page_size_is_an_error_not_a_traceback() -> None:
    done = run_probe("--backend", "host", "--page-size", "12345")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("error: page_size 12345 bytes is not a positive multiple")


def test_a_failing_close_is_a_fail_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault that only shows when the range is closed (a sticky CUDA error, say) must still
    give a result row, not escape the probe."""
    from elastickv.probes.vmm_probe import make_backend, run_case
    from elastickv.vmm import HostRange, VmmError

    real_close = HostRange.close

    def failing_close(self: HostRange) -> None:
        real_close(self)
        raise VmmError("simulated fault while closing")

    monkeypatch.setattr(HostRange, "close", failing_close)
    result = run_case(make_backend("host", None), CASES[0])
    assert not result.ok
    assert result.error is not None
    assert "closing the range: VmmError: simulated fault while closing" in result.error
