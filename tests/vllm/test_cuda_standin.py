"""An elastic engine on a stand-in CUDA platform (vLLM 0.32 and 0.28): ``plugin.install``
binds the GPU worker's and both model runners' hooks, the preflight refuses what elastickv
cannot serve when vLLM builds the engine config (before any engine process exists or any
weight loads: ROCm, an attention backend it does not place) and accepts what it does
(FlashAttention with an fp8 KV cache, vLLM's sleep mode), both runners'
``initialize_kv_cache`` place the cache on elastic storage through the installed hooks,
every view verified, and the sleep RPCs drive vLLM's own ``Worker.sleep`` / ``wake_up`` with
the KV cache kept out of vLLM's sleep-mode memory pool.

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
    "Worker._maybe_get_memory_pool_context",
    "Worker.execute_dummy_batch",
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
    found["log"] = done.stdout + done.stderr  # vLLM logs to stdout once it configured logging
    return found


def test_install_binds_the_gpu_worker_and_both_runners(report: dict[str, Any]) -> None:
    bindings = dict(report["bindings"])
    if report["contract"] == "0.28":  # its wake that names kv_cache zeroes a quantized cache
        assert bindings.pop("V1 GPUModelRunner.post_kv_cache_wake_up") is True
    assert "V1 GPUModelRunner.post_kv_cache_wake_up" not in bindings
    assert bindings == dict.fromkeys(HOOKS, True)


def test_free_memory_check_lets_an_engine_start_beside_others(report: dict[str, Any]) -> None:
    """vLLM's start-up check (half of a 100 GiB GPU asked, 10 GiB free) warns instead."""
    assert report["request_memory"] == 50 * GiB
    assert "elastickv starts the engine anyway" in report["stderr"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("rocm", "the rocm platform: elastickv places the KV cache on vLLM's CPU platform"),
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


def test_sleep_mode_is_accepted_with_its_memory_allocator(report: dict[str, Any]) -> None:
    assert report["sleep_mode"]["kv_cache_memory_bytes"] > 0
    assert report["sleep_mode"]["cumem_allocator"] is True


def test_the_kv_cache_never_enters_vllms_sleep_pool(report: dict[str, Any]) -> None:
    """With sleep mode's allocator on, the worker asks it for the weights' and the runtime
    state's pools, never for the KV cache's: no level releases or re-creates elastic KV."""
    pools = report["memory_pools"]
    assert pools["pools_asked"] == ["weights", "runtime"]
    assert pools["context"]["kv_cache"] == "nullcontext"


@pytest.mark.parametrize("level", [1, 2])
def test_a_gpu_worker_sleeps_and_wakes_through_vllms_sleep_mode(
    report: dict[str, Any], level: int
) -> None:
    """vLLM's own ``Worker.sleep(level)`` once (a second sleep changes nothing), then
    ``wake_up(["weights"])``; level 2 reloads the weights after the buffers came back. A step
    reaching a sleeping worker wakes it first."""
    run = report["sleep"][f"level{level}"]
    wake = [["resume", ["weights"]]] + ([["reload_weights", 7.0]] if level == 2 else [])
    assert run["calls"] == [["suspend", level], *wake, ["suspend", level], *wake]
    assert run["first"]["asleep"] and run["first"]["level"] == level
    assert run["first"]["released_bytes"] == 4096  # the pool's weights allocations
    assert run["again"]["released_bytes"] == 0
    assert run["woke"] == {"woken": True, "level": level} and run["woke_again"] is False
    assert run["buffer_after"] == 7.0


def test_a_gpu_sleep_refuses_clearly_and_tolerates_a_busy_gpu(report: dict[str, Any]) -> None:
    sleep = report["sleep"]
    refusals = sleep["refusals"]
    assert "started without --enable-sleep-mode" in refusals["no_sleep_mode"]
    assert "sleep level 3: use 1" in refusals["level_3"]
    assert "vLLM's own sleep mode has this engine suspended" in refusals["vllm_asleep"]
    # vLLM's check that free memory rose fails when another engine committed meanwhile.
    assert sleep["neighbour_committed"]["asleep"] is True
    assert "another engine committed meanwhile" in report["log"]
    assert sleep["dummy_batch"] == ["suspend", "resume", "dummy batch"]


def test_a_quantized_wake_keeps_the_elastic_kv_cache(report: dict[str, Any]) -> None:
    """vLLM 0.28 zeroes a quantized KV cache after a wake that names it; elastic storage was
    never released, so it is left as it is (the scales are reset as vLLM does)."""
    found = report["post_wake"]
    if report["contract"] != "0.28":
        assert found is None  # 0.32 has no such step
        return
    assert found["native"] == {"kv": 0.0, "kv_caches_kept": True, "k_scale": 1.0}
    assert found["elastic"] == {"kv": 4.0, "kv_caches_kept": True, "k_scale": 1.0}


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_initialize_kv_cache_places_on_elastic_storage(report: dict[str, Any], runner: str) -> None:
    assert report[runner] == {
        "placed": True,
        "device": "host",
        "views_verified": True,
        "bound": True,
    }
