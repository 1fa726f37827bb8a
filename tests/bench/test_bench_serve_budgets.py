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
from elastickv.serve.config import load_config

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
@pytest.mark.parametrize("count", [1, 2, 3, 4, 6, 7])
def test_every_engine_starts_at_the_smallest_elastic_budget(
    bench: ModuleType, min_kv: str, count: int
) -> None:
    fleet = bench.Fleet(count, min_kv)
    floors = fleet.min_kv_bytes
    budget = fleet.smallest_elastic_budget()
    assert budget % bench.PAGE_BYTES == 0 and budget >= sum(floors.values())
    request = -(-bench.MAX_MODEL_LEN // bench.BLOCK_SIZE)
    for name, shape in fleet.shapes.items():
        cap = budget - (sum(floors.values()) - floors[name])  # serve's cap of the model
        assert usable_blocks(bench, shape, cap) >= request
    if count == 3:
        assert (budget, min_kv) in {(3328 << 10, "request"), (2112 << 10, "floor")}
    assert fleet.starts("elastic", budget)
    assert not fleet.starts("elastic", budget - bench.PAGE_BYTES)


def test_a_fleet_cycles_the_shapes_under_names_of_their_own(bench: ModuleType) -> None:
    assert bench.Fleet(7).shapes == {
        "tiny-llama": "tiny-llama",
        "tiny-llama-bf16": "tiny-llama-bf16",
        "tiny-llama-deep": "tiny-llama-deep",
        "tiny-llama-2": "tiny-llama",
        "tiny-llama-bf16-2": "tiny-llama-bf16",
        "tiny-llama-deep-2": "tiny-llama-deep",
        "tiny-llama-3": "tiny-llama",
    }
    assert bench.Fleet().names == bench.MODELS == bench.SHAPES


def test_the_static_split_starts_until_a_share_is_below_a_floor(bench: ModuleType) -> None:
    """8M split four ways leaves 2M for the deep model (it needs 1664K); five ways 1.6M."""
    budget = 8 << 20
    assert bench.Fleet(4).starts("static", budget)
    assert not bench.Fleet(5).starts("static", budget)
    assert "tiny-llama-deep needs 1664K" in bench.Fleet(5).static_error(budget)
    assert bench.Fleet().smallest_static_budget() == 4992 << 10


def test_a_fleet_beyond_three_waits_a_ramp_gap_longer_per_model_before_stopping(
    bench: ModuleType,
) -> None:
    """The last of k models bursts (k - 1) ramp gaps (27 s at P = 12) after the first: its
    engine must not be stopped as idle before (a wake is an engine start, not memory)."""
    assert bench.Fleet(3).stop_after_s(12) == bench.STOP_AFTER_S == 90
    for count in (4, 6, 9):
        stop = bench.Fleet(count).stop_after_s(12)
        assert stop - (count - 1) * 27 >= 36


def test_the_config_serves_each_name_with_its_shape(bench: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(bench.config_text("elastic", 8 << 20, 8000, tmp_path, bench.Fleet(4), 12))
    config = load_config(path)
    assert [(m.name, m.source, m.min_kv) for m in config.models] == [
        ("tiny-llama", "tiny-llama", 512 << 10),
        ("tiny-llama-bf16", "tiny-llama-bf16", 1 << 20),
        ("tiny-llama-deep", "tiny-llama-deep", 1536 << 10),
        ("tiny-llama-2", "tiny-llama", 512 << 10),
    ]


@pytest.mark.parametrize(
    ("tier", "tiers"), [("stop", (5.0, None, 90.0)), ("asleep", (5.0, 30.0, None))]
)
def test_the_elastic_arms_idle_tier(
    bench: ModuleType, tmp_path: Path, tier: str, tiers: tuple[float | None, ...]
) -> None:
    """``--tier``: an idle model's engine stops (and never sleeps), or its weights sleep
    (and it never stops), in time for the idle workload's gaps."""
    path = tmp_path / "serve.toml"
    path.write_text(bench.config_text("elastic", 8 << 20, 8000, tmp_path, bench.Fleet(tier=tier)))
    for m in load_config(path).models:
        assert (m.release_after_s, m.sleep_after_s, m.stop_after_s) == tiers
    assert bench.SLEEP_AFTER_S < bench.IDLE_GAP_S / 2


def test_the_committed_results_print_as_docs_benchmarks_quotes_them(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSONs under docs/results are read back by the printers of today's script."""
    import json

    results = SCRIPT.parents[1] / "docs" / "results"
    bench.print_fit(json.loads((results / "bench-serve-fit.json").read_text()))
    bench.print_sweep(json.loads((results / "bench-serve-sweep.json").read_text()))
    out = capsys.readouterr().out
    assert "most models meeting the target: 2 (one more misses the target)" in out
    assert "most models meeting the target: 5 (one more misses the target)" in out
    assert "models elastic / static: 2.50" in out
    assert "B_static / B_elastic = 2.11" in out
    for tier in ("asleep", "stop"):
        bench.print_table(json.loads((results / f"bench-serve-idle-{tier}.json").read_text()))
    asleep, stop = capsys.readouterr().out.split("KV budget B")[1:]
    assert "first request after an idle gap (3): TTFT mean 106ms/73ms, p99 168ms/84ms" in asleep
    assert "its weights asleep (after 30 s idle" in asleep
    assert "first request after an idle gap (3): TTFT mean 95ms/21.86s" in stop
    assert "0.805/0.168" in asleep and "0.803/0.158" in stop  # KV GiB·s, all models
