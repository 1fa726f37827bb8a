"""``benchmarks/bench_serve.py``'s smallest budgets, against the rule the plugin advertises
capacity by: a sweep that starts its elastic arm below what an engine needs fails at once
(3200K, the static floors' sum, left the float32 deep model 12 usable blocks of 13)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.worker.capacity import advertised_capacity
from elastickv.models import get_builtin_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serve_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def usable_blocks(bench: ModuleType, model: str, capacity: int) -> int:
    """The blocks vLLM gets from an elastic engine of ``capacity`` bytes (the advertised
    bytes, one block of them vLLM's null block)."""
    spec = get_builtin_model(model)
    block = bench.BLOCK_SIZE * spec.kv_bytes_per_token
    layer = block // spec.num_hidden_layers
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            get_kv_cache_spec=lambda: {
                f"layer.{i}": SimpleNamespace(page_size_bytes=layer, block_size=bench.BLOCK_SIZE)
                for i in range(spec.num_hidden_layers)
            }
        ),
        vllm_config=SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=256),
            model_config=SimpleNamespace(max_model_len=bench.MAX_MODEL_LEN),
        ),
    )
    config = ElasticConfig(page_size=bench.PAGE_BYTES, virtual_capacity_bytes=capacity)
    return int(advertised_capacity(worker, config) // block) - 1


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llama-bf16", "tiny-llama-deep"])
def test_the_elastic_floor_is_the_least_capacity_that_holds_a_request(
    bench: ModuleType, model: str
) -> None:
    request = -(-bench.MAX_MODEL_LEN // bench.BLOCK_SIZE)
    floor = bench.elastic_floor(model)
    assert usable_blocks(bench, model, floor) >= request
    assert usable_blocks(bench, model, floor - bench.PAGE_BYTES) < request


@pytest.mark.parametrize("min_kv", ["request", "floor"])
def test_every_engine_starts_at_the_smallest_elastic_budget(bench: ModuleType, min_kv: str) -> None:
    floors = bench.MIN_KV_CHOICES[min_kv]
    budget = bench.smallest_elastic_budget(floors)
    assert budget % bench.PAGE_BYTES == 0 and budget >= sum(floors.values())
    request = -(-bench.MAX_MODEL_LEN // bench.BLOCK_SIZE)
    for model in bench.MODELS:
        cap = budget - (sum(floors.values()) - floors[model])  # serve's cap of the model
        assert usable_blocks(bench, model, cap) >= request
    assert (budget, min_kv) in {(3328 << 10, "request"), (2112 << 10, "floor")}
