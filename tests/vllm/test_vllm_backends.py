"""The backend loader of the contract files: ``vllm._C`` refused only where it cannot run."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
from vllm_backends import RefuseUnrunnableKernels, cpu_runs_vllm_c


def test_only_vllms_default_kernel_library_is_refused() -> None:
    finder = RefuseUnrunnableKernels()
    with pytest.raises(ImportError, match="AVX512-BF16"):
        finder.find_spec("vllm._C", None)
    for other in ("vllm._C_AVX2", "vllm._C_AVX512", "vllm._C_stable_libtorch", "vllm"):
        assert finder.find_spec(other, None) is None


@pytest.mark.skipif(platform.machine() != "x86_64", reason="vLLM's rule is for x86 CPUs")
def test_the_cpu_rule_follows_the_cpus_flags() -> None:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert cpu_runs_vllm_c() == ({"avx512f", "avx512_bf16"} <= flags)
