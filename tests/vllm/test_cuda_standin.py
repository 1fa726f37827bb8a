"""An elastic engine on a stand-in CUDA platform (vLLM 0.32 and 0.28): ``plugin.install``
binds the GPU worker's and both model runners' hooks, the preflight refuses what elastickv
cannot serve when vLLM builds the engine config (before any engine process exists or any
weight loads: ROCm, sleep mode, an attention backend it does not place) and accepts what it
does (FlashAttention with an fp8 KV cache), and both runners' ``initialize_kv_cache`` place
the cache on elastic storage through the installed hooks, every view verified.

It runs in a process of its own (``cuda_standin.py``): the stand-in and the hooks change
vLLM for the whole process, and the engine tests share this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastickv.integrations.vllm import preflight

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("cuda_standin.py")
HOOKS = (
    "Worker.determine_available_memory",
    "gpu_worker.request_memory",
    "V1 GPUModelRunner.initialize_kv_cache",
    "V1 GPUModelRunner.initialize_kv_cache_tensors",
    "V1 GPUModelRunner.execute_model",
    "V1 GPUModelRunner.sample_tokens",
    "V2 GPUModelRunner.initialize_kv_cache",
    "V2 GPUModelRunner.execute_model",
    "V2 model_runner.init_kv_cache",
)
GiB = 1 << 30


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    ledger = tmp_path_factory.mktemp("ledger")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), model, str(ledger)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    found["stderr"] = done.stderr
    return found


def test_install_binds_the_gpu_worker_and_both_runners(report: dict[str, Any]) -> None:
    assert report["bindings"] == dict.fromkeys(HOOKS, True)


def test_free_memory_check_lets_an_engine_start_beside_others(report: dict[str, Any]) -> None:
    """vLLM's start-up check (half of a 100 GiB GPU asked, 10 GiB free) warns instead."""
    assert report["request_memory"] == 50 * GiB
    assert "elastickv starts the engine anyway" in report["stderr"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("rocm", "the rocm platform: elastickv places the KV cache on vLLM's CPU platform"),
        ("sleep_mode", "--enable-sleep-mode: vLLM's sleep mode discards and re-creates"),
        (
            "cpu_backend_on_cuda",
            "--attention-backend CPU_ATTN: elastickv supports "
            + ", ".join(preflight.SUPPORTED_ATTENTION_BACKENDS["cuda"]),
        ),
    ],
)
def test_preflight_refuses_when_the_engine_config_is_built(
    report: dict[str, Any], case: str, message: str
) -> None:
    refused = report[case].get("refused", "")
    assert message in refused, report[case]
    assert "unset ELASTICKV to run vLLM without elastickv" in refused


def test_preflight_accepts_flash_attention_with_fp8(report: dict[str, Any]) -> None:
    """What the runner contract tests place is accepted, and the KV cache is sized elsewhere
    (the GPU worker then skips its free-memory profiling)."""
    assert report["flash_attn_fp8"]["kv_cache_memory_bytes"] > 0


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_initialize_kv_cache_places_on_elastic_storage(report: dict[str, Any], runner: str) -> None:
    assert report[runner] == {
        "placed": True,
        "device": "host",
        "views_verified": True,
        "bound": True,
    }
