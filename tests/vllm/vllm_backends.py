"""vLLM's attention backends, imported in a test process whatever the CPU (no vLLM import here).

The contract tests import every ``AttentionBackendEnum`` member's class and record the error
of each that does not import. One import would not fail but kill the process: see
:class:`RefuseUnrunnableKernels`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import platform
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch


class RefuseUnrunnableKernels(importlib.abc.MetaPathFinder):
    """Refuses ``import vllm._C`` as an ``ImportError`` on an x86 CPU without AVX512-BF16.

    The x86 wheel's ``_C`` library runs AVX512 instructions as it loads, so on such a CPU
    the interpreter dies with SIGILL. vLLM's CPU platform never loads it there (its
    ``import_kernels`` picks ``_C_AVX2`` or ``_C_AVX512``), but its ROCm platform module,
    which the ROCm attention backends import, does so unconditionally inside a ``try`` that
    already tolerates an ``ImportError``: the backend then imports as on a host without
    the library, and its classes are the same."""

    NAME = "vllm._C"

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == self.NAME:
            raise ImportError(
                f"{self.NAME} is built for AVX512-BF16, which this CPU lacks "
                "(vLLM's CPU platform loads _C_AVX2 here)"
            )
        return None


def cpu_runs_vllm_c() -> bool:
    """Whether this CPU can load ``vllm._C``: vLLM's own rule (``CpuPlatform.import_kernels``)
    on x86, any other architecture's wheel being built for it."""
    if platform.machine() not in ("x86_64", "AMD64", "i386", "i686"):
        return True
    return bool(torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported())


def load_backends(members: Iterable[Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each ``AttentionBackendEnum`` member's class, or the error its import raised."""
    guard = None if cpu_runs_vllm_c() else RefuseUnrunnableKernels()
    if guard is not None:
        sys.meta_path.insert(0, guard)
    classes: dict[str, Any] = {}
    errors: dict[str, str] = {}
    try:
        for member in members:
            try:
                classes[member.name] = member.get_class()
            except Exception as exc:  # any import failure is a finding to record
                errors[member.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        if guard is not None:
            sys.meta_path.remove(guard)
    return classes, errors
