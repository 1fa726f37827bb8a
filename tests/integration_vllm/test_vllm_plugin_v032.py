"""elastickv's vLLM plugin against real vLLM 0.32 (in-process engine), compared with native vLLM.

Each engine runs in its own subprocess (``vllm_runner.py``, memoised by ``conftest.runs``)
so every run is a clean vLLM process; the native and elastic runs differ only in
``ELASTICKV*`` variables. Run with the 0.32 venv: ``python -m pytest tests/integration_vllm``.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from plugin_harness import ELASTIC, PAGE, assert_footprint_follows_blocks

from elastickv.integrations.vllm.config import ElasticConfig, enabled
from elastickv.integrations.vllm.contract import detect_contract
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.worker.commit_check import CommitCheck, CommitOrderError
from elastickv.vmm import host_granularity
from elastickv.vmm.host import HostPool

EngineRuns = Callable[..., dict[str, Any]]


# -- settings and contract (no engine) -------------------------------------------------------


def test_config_parses_and_validates() -> None:
    cfg = ElasticConfig.from_env({"ELASTICKV_PAGE_SIZE": "64K", "ELASTICKV_BUDGET": "1M"})
    # Strictness unset: the device's default (strict on the host, a zero page on a GPU).
    assert (cfg.page_size, cfg.budget_bytes, cfg.strict) == (64 << 10, 1 << 20, None)
    assert ElasticConfig.from_env({"ELASTICKV_STRICT": "0"}).strict is False
    assert enabled({"ELASTICKV": "1"}) and not enabled({})
    with pytest.raises(ElasticKVStartupError, match="ELASTICKV_PAGE_SIZ"):
        ElasticConfig.from_env({"ELASTICKV_PAGE_SIZ": "64K"})
    with pytest.raises(ElasticKVStartupError, match="HOT_MIN"):
        ElasticConfig.from_env({"ELASTICKV_HOT_MIN_PAGES": "9", "ELASTICKV_HOT_MAX_PAGES": "1"})
    with pytest.raises(ElasticKVStartupError, match="ELASTICKV_PAGE_SIZE"):
        ElasticConfig.from_env({"ELASTICKV_PAGE_SIZE": "1000"})


def test_unsupported_vllm_version_fails_naming_it() -> None:
    with pytest.raises(ElasticKVStartupError, match=r"vLLM 0\.30\.1.*supported: 0\.32\.x"):
        detect_contract("0.30.1")
    assert detect_contract().value == "0.32"


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


def test_commit_check_catches_uncommitted_pages() -> None:
    """The guard the elastic runs enable: a forward touching a hole must fail loudly."""
    page = host_granularity()
    with HostPool.create(4 * page, page_size=page) as pool:
        view = mmap.mmap(pool.fd, 4 * page, flags=mmap.MAP_SHARED)
        check = CommitCheck(pool.fd)
        pool.allocate(1, 1)

        def write(at: int) -> int:
            view[at] = 7
            return at

        assert check.run(lambda: write(page + 5)) == page + 5  # committed page: fine
        with pytest.raises(CommitOrderError, match=f"touched {page} bytes"):
            check.run(lambda: write(2 * page))
        assert check.forwards == 1
        view.close()


# -- native vs elastic ------------------------------------------------------------------------


# One engine per configuration: functional prompts, then 16 concurrent requests (prefix
# caching on, vLLM's default); the bf16 model runs without prefix caching so its footprint
# must drain back to the hot reserve.
ALL = ("all", "--max-tokens", "64")
BF16 = ("concurrent", "--max-tokens", "32", "--no-prefix-caching")


def test_functional_prompts_identical(runs: EngineRuns) -> None:
    native = runs("tiny-llama", *ALL)
    elastic = runs("tiny-llama", *ALL, **ELASTIC)
    assert not native["elastic"] and elastic["elastic"]
    assert elastic["num_blocks"] > native["num_blocks"]  # virtual capacity advertised
    assert elastic["functional"] == native["functional"]
    assert elastic["functional"][:4] == elastic["functional"][4:]  # repeated prompts are stable
    assert not elastic["shutdown"]["left"]


def test_concurrent_identical_with_prefix_caching(runs: EngineRuns) -> None:
    native = runs("tiny-llama", *ALL)
    elastic = runs("tiny-llama", *ALL, **ELASTIC)
    assert len(elastic["concurrent"]) == 16
    assert all(len(t) == 64 for t in elastic["concurrent"])
    assert elastic["concurrent"] == native["concurrent"]
    after = elastic["after"]
    # Only prefix-cached (parked) blocks keep pages once every request finished.
    assert after["live_blocks"] == after["parked_blocks"] > 0, after
    assert after["footprint_bytes"] <= max(s["footprint_bytes"] for s in elastic["samples"])


def test_second_model_bf16_identical(runs: EngineRuns) -> None:
    native = runs("tiny-llama-bf16", *BF16)
    elastic = runs("tiny-llama-bf16", *BF16, **ELASTIC)
    assert elastic["elastic"] and elastic["concurrent"] == native["concurrent"]
    assert all(len(t) == 32 for t in elastic["concurrent"])


def test_footprint_follows_blocks(runs: EngineRuns) -> None:
    elastic = runs("tiny-llama-bf16", *BF16, **ELASTIC)
    assert_footprint_follows_blocks(elastic)


def test_budget_forces_preemption_identical_outputs(runs: EngineRuns) -> None:
    native = runs("tiny-llama", *ALL)
    budget = 5 * PAGE
    args = ("concurrent", "--max-tokens", "64")
    elastic = runs("tiny-llama", *args, ELASTICKV_BUDGET=str(budget), **ELASTIC)
    assert elastic["preemptions"] > 0 and native["preemptions"] == 0
    assert elastic["after"]["refusals"] > 0
    assert max(s["footprint_bytes"] for s in elastic["samples"]) <= budget
    assert elastic["concurrent"] == native["concurrent"]


def test_budget_with_prefix_hits_on_parked_blocks(runs: EngineRuns) -> None:
    """Long prompts (several full blocks) under a tight budget: preempted requests come back
    as prefix-cache hits on their own parked blocks while the budget is full; outputs stay
    identical (the exact pool-level case is in test_vllm_plugin_v032_block_pool.py)."""
    args = ("long", "--max-tokens", "64")
    native = runs("tiny-llama", *args)
    elastic = runs("tiny-llama", *args, ELASTICKV_BUDGET=str(12 * PAGE), **ELASTIC)
    assert elastic["preemptions"] > 0
    assert elastic["after"]["refusals"] > 0
    assert max(s["footprint_bytes"] for s in elastic["samples"]) <= 12 * PAGE
    assert elastic["concurrent"] == native["concurrent"]


# -- start-up refusals ------------------------------------------------------------------------


def test_layout_or_spec_the_plugin_cannot_place_fails_naming_it() -> None:
    """vLLM 0.32's CPU backend accepts only the LBHNC layout (it refuses any other
    ``VLLM_KV_CACHE_LAYOUT`` itself), so the plugin's own check runs where it runs: on the
    ``KVCacheConfig`` and layout name ``initialize_kv_cache_tensors`` receives."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    from elastickv.integrations.vllm.worker.geometry_v032 import geometry_from_config

    def config(spec: FullAttentionSpec, blocks: int = 5) -> KVCacheConfig:
        names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        page = spec.page_size_bytes
        tensor = KVCacheTensor(
            size=2 * page * blocks, layers=names, layer_stride=page * blocks, block_stride=page
        )
        return KVCacheConfig(blocks, [tensor], [KVCacheGroupSpec(names, spec)])

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16)
    assert geometry_from_config(config(spec), "LBHNC", 32).num_blocks == 5
    with pytest.raises(ElasticKVStartupError, match="rejects vLLM's KV cache geometry: layout"):
        geometry_from_config(config(spec), "LBCHN", 32)
    window = FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64
    )
    with pytest.raises(ElasticKVStartupError, match="sliding window 64"):
        geometry_from_config(config(window), "LBHNC", 32)


def test_fp8_kv_cache_fails_engine_startup_naming_it(cache_root: Path, tmp_path: Path) -> None:
    """``kv_cache_dtype="fp8"`` (accepted by vLLM's CPU backend) is refused by the plugin by
    the option's name, as soon as the engine config exists (before any weight loads);
    nothing of the engine and no ledger record is left."""
    from plugin_harness import assert_refused_before_weights, failing_start

    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    got = failing_start(cache_root, model, {"kv_cache_dtype": "fp8"}, ELASTIC, tmp_path / "l")
    assert got["returncode"] != 0 and "ENGINE STARTED" not in got["stdout"]
    assert "ElasticKVStartupError" in got["stderr"]
    assert "--kv-cache-dtype fp8 (a quantized KV cache); use --kv-cache-dtype auto" in got["stderr"]
    assert_refused_before_weights(got)
    assert not got["left"] and got["ledger"] == []


@pytest.mark.parametrize(
    ("llm_kwargs", "message"),
    [
        ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size 2: elastickv commits a block"),
        ({"attention_backend": "FLASH_ATTN"}, "--attention-backend FLASH_ATTN: elastickv supports"),
    ],
    ids=["pipeline-parallel", "attention-backend"],
)
def test_unsupported_options_refused_before_weights_load(
    cache_root: Path, tmp_path: Path, llm_kwargs: dict[str, Any], message: str
) -> None:
    from plugin_harness import assert_refused_before_weights, failing_start

    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    got = failing_start(cache_root, model, llm_kwargs, ELASTIC, tmp_path / "l")
    assert got["returncode"] != 0 and "ENGINE STARTED" not in got["stdout"]
    assert message in got["stderr"], got["stderr"][-3000:]
    assert "unset ELASTICKV to run vLLM without elastickv" in got["stderr"]
    assert_refused_before_weights(got)
    assert not got["left"] and got["ledger"] == []


def test_budget_below_the_floor_states_the_minimum(cache_root: Path, tmp_path: Path) -> None:
    """``ELASTICKV_BUDGET`` below what the null block's pages need: the error echoes the
    setting as typed and states the minimum exactly, as the user can set it (and no ledger
    record is left to look for)."""
    import re

    from plugin_harness import failing_start

    from elastickv.models import ensure_tiny_model
    from elastickv.units import parse_size

    model = str(ensure_tiny_model("tiny-llama"))
    extra = {**ELASTIC, "ELASTICKV_PAGE_SIZE": "4K", "ELASTICKV_BUDGET": "4K"}
    got = failing_start(cache_root, model, {}, extra, tmp_path / "l")
    assert got["returncode"] != 0 and "ENGINE STARTED" not in got["stdout"]
    found = re.search(
        r"ELASTICKV_BUDGET=4K \(4\.0 KiB\) is below the minimum: this engine needs at least "
        r"(\d+K) to start: its null block's (\d+) pages of 4\.0 KiB",
        got["stderr"],
    )
    assert found is not None, got["stderr"][-3000:]
    minimum = parse_size(found.group(1))  # exact, as the user types it
    assert minimum == int(found.group(2)) * 4096 > 4096
    assert f"Set ELASTICKV_BUDGET to at least {found.group(1)}" in got["stderr"]
    assert "elastickv list" not in got["stderr"]
    assert not got["left"] and got["ledger"] == []


def test_settings_without_elastickv_on_warn(cache_root: Path) -> None:
    """``ELASTICKV_BUGDET=2G`` without ``ELASTICKV=1``: vLLM runs natively, and says that the
    elastickv settings do nothing."""
    code = "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")} | {
        "ELASTICKV_BUGDET": "2G",
        "VLLM_CACHE_ROOT": str(cache_root),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "ELASTICKV_BUGDET set but ELASTICKV=1 is not" in log, log[-3000:]
