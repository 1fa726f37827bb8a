"""elastickv's vLLM plugin against real vLLM 0.28 (the 0.28 KV-cache contract), compared with
native vLLM: per-layer KV tensors placed back to back in one elastic range, views verified
against ``KVCacheGeometry(contract="0.28")``, the 0.32 block pool adapted to 0.28's.

Each engine runs in its own subprocess (``vllm_runner.py``, memoised by ``conftest.runs``);
native and elastic runs differ only in ``ELASTICKV*`` variables (and the multiprocessing
switch). Run with the 0.28 venv: ``python -m pytest tests/integration_vllm``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from plugin_harness import ELASTIC, PAGE, assert_footprint_follows_blocks
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from elastickv.geometry import Contract, KVLayout, layer_views
from elastickv.integrations.vllm import contract as contract_module
from elastickv.integrations.vllm.contract import detect_contract, installed_version
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.worker.geometry_v028 import plan_from_config

EngineRuns = Callable[..., dict[str, Any]]


# -- contract and geometry (no engine) --------------------------------------------------------


def test_detect_contract_picks_0_28_by_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    assert installed_version().startswith("0.28.")
    assert detect_contract() is Contract.V028
    assert detect_contract("0.30.1") is Contract.V028  # same capability, version in range
    with pytest.raises(ElasticKVStartupError, match=r"does not support vLLM 0\.27\.0.*0\.28\.x"):
        detect_contract("0.27.0")
    monkeypatch.setattr(contract_module, "_has_v028_contract", lambda: False)
    with pytest.raises(ElasticKVStartupError, match=r"vLLM 0\.28\.\S+ lacks the 0\.28 KV-cache"):
        detect_contract()


def test_unsupported_version_fails_engine_startup(cache_root: Path) -> None:
    """The plugin raises inside vLLM's plugin loading: no silent native fallback."""
    code = (
        "import vllm; vllm.__version__ = '0.99.0'\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
    )
    env = dict(os.environ, ELASTICKV="1", VLLM_CACHE_ROOT=str(cache_root))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "does not support vLLM 0.99.0" in proc.stderr
    assert "0.28.x–0.31.x (0.28 contract)" in proc.stderr


def test_plugin_inert_without_elastickv(cache_root: Path) -> None:
    code = "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")}
    env["VLLM_CACHE_ROOT"] = str(cache_root)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def _config(layers: int, blocks: int, shared: bool = False) -> tuple[KVCacheConfig, int]:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    size = spec.page_size_bytes * blocks
    tensors = (
        [KVCacheTensor(size=size, shared_by=names)]
        if shared
        else [KVCacheTensor(size=size, shared_by=[n]) for n in names]
    )
    return KVCacheConfig(blocks, tensors, [KVCacheGroupSpec(names, spec)]), size


def test_plan_matches_vllm_views_and_rejects_what_it_cannot_place() -> None:
    """Our plan for the CPU backend reproduces vLLM 0.28's own per-layer views (built the way
    ``_reshape_attention_kv_cache`` does) at ``l × layer bytes`` of one backing."""
    cpu = AttentionBackendEnum.CPU_ATTN.get_class()
    config, size = _config(layers=3, blocks=5)
    plan = plan_from_config(config, cpu, 32)
    assert plan.layer_bytes == size and plan.size_bytes == 3 * size
    assert plan.geometry.layout is KVLayout.LBHNC  # identity stride order: HND per layer
    backing = torch.zeros(plan.size_bytes, dtype=torch.int8)
    shape = cpu.get_kv_cache_shape(5, 32, 2, 16)
    for layer, mine in enumerate(layer_views(plan.geometry)):
        raw = backing[layer * size : (layer + 1) * size]
        theirs = raw.view(torch.float16).view(shape)  # identity order: no permute
        got = (tuple(theirs.shape), tuple(theirs.stride()), theirs.storage_offset())
        assert got == (mine.shape, mine.stride, mine.storage_offset)
    # ROCm's split K/V planes (tests/vllm/test_runner_contract_v028.py: every backend).
    with pytest.raises(ElasticKVStartupError, match="ROCM_ATTN attention backend"):
        plan_from_config(config, AttentionBackendEnum.ROCM_ATTN.get_class(), 32)
    shared, _ = _config(layers=2, blocks=5, shared=True)
    with pytest.raises(ElasticKVStartupError, match="one unpacked KVCacheTensor per layer"):
        plan_from_config(shared, cpu, 32)


# -- native vs elastic ------------------------------------------------------------------------


ALL = ("all", "--max-tokens", "64")
BF16 = ("concurrent", "--max-tokens", "32", "--no-prefix-caching")


# The in-process elastic run has a 5-page budget, so it also proves that pool exhaustion
# becomes vLLM's "cannot schedule now" (preempt and retry), never a crash.
BUDGET = 5 * PAGE
BUDGETED = {"ELASTICKV_BUDGET": str(BUDGET), **ELASTIC}


def test_functional_prompts_identical(runs: EngineRuns) -> None:
    native = runs("tiny-llama", *ALL)
    elastic = runs("tiny-llama", *ALL, **BUDGETED)
    assert not native["elastic"] and elastic["elastic"]
    assert elastic["num_blocks"] > native["num_blocks"]  # virtual capacity advertised
    assert elastic["functional"] == native["functional"]
    assert elastic["functional"][:4] == elastic["functional"][4:]
    assert not elastic["shutdown"]["left"]


def test_concurrent_identical_under_budget_with_prefix_caching(runs: EngineRuns) -> None:
    native = runs("tiny-llama", *ALL)
    elastic = runs("tiny-llama", *ALL, **BUDGETED)
    assert len(elastic["concurrent"]) == 16
    assert all(len(t) == 64 for t in elastic["concurrent"])
    assert elastic["concurrent"] == native["concurrent"]
    print(f"\n[vllm-0.28 elastic budget] preempted {elastic['preemptions']}: {elastic['after']}")
    assert elastic["preemptions"] > 0 and native["preemptions"] == 0
    assert elastic["after"]["refusals"] > 0
    assert max(s["footprint_bytes"] for s in elastic["samples"]) <= BUDGET
    after = elastic["after"]
    assert after["live_blocks"] == after["parked_blocks"] > 0, after  # only prefix cache


def test_second_model_bf16_identical_and_footprint_follows_blocks(runs: EngineRuns) -> None:
    native = runs("tiny-llama-bf16", *BF16)
    elastic = runs("tiny-llama-bf16", *BF16, **ELASTIC)
    assert elastic["concurrent"] == native["concurrent"]
    assert all(len(t) == 32 for t in elastic["concurrent"])
    idle, peak = assert_footprint_follows_blocks(elastic)
    print(f"\n[vllm-0.28 elastic bf16] idle {idle} peak {peak} after {elastic['after']}")


def test_multiprocess_identical_to_native(runs: EngineRuns) -> None:
    """Default multiprocess mode: the engine core drives the worker process's pool."""
    native = runs("tiny-llama", *ALL)
    elastic = runs("tiny-llama", *ALL, mp=True, **ELASTIC)
    assert elastic["elastic"]
    assert elastic["functional"] == native["functional"]
    assert elastic["concurrent"] == native["concurrent"]
    names = " ".join(elastic["shutdown"]["children"].values())
    assert "EngineCore" in names and "Worker" in names, names
    assert not elastic["shutdown"]["left"], elastic["shutdown"]
    idle = elastic["idle"]["footprint_bytes"]
    peak = max(s["footprint_bytes"] for s in elastic["samples"])
    print(f"\n[vllm-0.28 elastic mp] idle {idle} peak {peak} after {elastic['after']}")
    assert peak >= 4 * idle > 0


def test_fp8_kv_cache_fails_engine_startup_naming_it(cache_root: Path, tmp_path: Path) -> None:
    """``kv_cache_dtype="fp8"`` (accepted by vLLM's CPU backend) is refused by the plugin by
    the option's name, as soon as the engine config exists (before any weight loads);
    nothing of the engine and no ledger record is left. (The backend refusal is
    ``test_plan_matches_vllm_views_and_rejects_what_it_cannot_place``: vLLM 0.28 on CPU
    only ever selects ``CPU_ATTN``, so the plugin's check is driven with FLASH_ATTN there.)"""
    from plugin_harness import assert_refused_before_weights, failing_start

    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    got = failing_start(cache_root, model, {"kv_cache_dtype": "fp8"}, ELASTIC, tmp_path / "l")
    assert got["returncode"] != 0 and "ENGINE STARTED" not in got["stdout"]
    assert "ElasticKVStartupError" in got["stderr"]
    assert "--kv-cache-dtype fp8 (a quantized KV cache); use --kv-cache-dtype auto" in got["stderr"]
    assert_refused_before_weights(got)
    assert not got["left"] and got["ledger"] == []
