"""A running elastic engine's weights released and reloaded in place (real vLLM, CPU), shared
by the 0.28 and 0.32 files that import these tests.

vLLM's CPU worker cannot sleep; elastickv's worker RPCs ``elastickv_sleep_weights`` and
``elastickv_wake_weights`` empty the model's parameters and drop the CPU backend's packed
linear weights, then reload the checkpoint into the same model and repack. One engine start
(``sleep_engine.py``, in-process) runs three sleep / wake cycles on a 42 MB model; the last
cycle's request reaches the sleeping engine and wakes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from plugin_harness import ELASTIC, hermetic_env

from elastickv.integrations.vllm.worker import weights_sleep
from elastickv.models import TinyModelSpec, ensure_tiny_model

__all__ = [
    "sleep_run",
    "test_a_request_to_a_sleeping_engine_wakes_it_and_is_answered",
    "test_outputs_after_every_wake_equal_the_reference",
    "test_release_and_restore_keep_the_parameter_objects",
    "test_sleep_releases_the_weights_memory",
    "test_wake_reports_reload_and_restore",
]

# Large enough for its weights to stand out of the engine's own memory, small enough to build
# in a second: 4 layers, hidden 512, about 10.5 M float32 parameters.
SLEEP_SPEC = TinyModelSpec(
    name="sleep-llama",
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    seed=4,
)
CYCLES = 3
SCRIPT = Path(__file__).with_name("sleep_engine.py")


def test_release_and_restore_keep_the_parameter_objects() -> None:
    """On any module: parameters emptied in place (tied ones once), packed closures dropped;
    restored storage has the old shapes, and a second release finds nothing."""
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    linear = model[1]
    linear.weight = model[0].weight  # tied, as an LM head to its embedding
    linear.__dict__["cpu_linear"] = lambda x, w, b: x  # what vLLM's CPU GEMM dispatch leaves
    params = list(model.parameters())
    emptied, released, packed = weights_sleep.release_weights(model)
    assert (released, packed) == ((8 * 4 + 8) * 4, 1)
    assert [p.numel() for p in model.parameters()] == [0, 0]
    assert weights_sleep.still_released(model) == ["1"]
    with pytest.raises(RuntimeError, match="asleep"):
        linear.__dict__["cpu_linear"](None, None, None)
    assert weights_sleep.release_weights(model)[1:] == (0, 0)
    weights_sleep.restore_storage(emptied)
    assert list(model.parameters()) == params
    assert [tuple(p.shape) for p in model.parameters()] == [(8, 4), (8,)]


@pytest.fixture(scope="module")
def sleep_run(cache_root: Path) -> dict[str, Any]:
    model = str(ensure_tiny_model(SLEEP_SPEC))
    env = hermetic_env(cache_root, ELASTIC, multiprocess=False)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), model, str(CYCLES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    documents = [line for line in proc.stdout.splitlines() if line.startswith('{"')]
    assert documents, proc.stdout[-2000:]
    result: dict[str, Any] = json.loads(documents[-1])
    return result


def test_outputs_after_every_wake_equal_the_reference(sleep_run: dict[str, Any]) -> None:
    assert len(sleep_run["cycles"]) == CYCLES
    for cycle in sleep_run["cycles"]:
        assert cycle["outputs"] == sleep_run["reference"]
    # Random weights give varied tokens: the comparison is not one token repeated.
    assert len({t for ids in sleep_run["reference"] for t in ids}) > 8


def test_sleep_releases_the_weights_memory(sleep_run: dict[str, Any]) -> None:
    weights = SLEEP_SPEC.num_parameters * 4
    linears = SLEEP_SPEC.num_hidden_layers * 4 + 2  # qkv, o, gate_up, down; embedding, head
    for cycle in sleep_run["cycles"]:
        slept = cycle["slept"]
        assert slept["packed_layers"] == linears
        # The parameters vLLM keeps: embedding, LM head, norms (linears are packed copies).
        assert slept["released_bytes"] >= 2 * SLEEP_SPEC.vocab_size * SLEEP_SPEC.hidden_size * 4
        # PSS's anonymous part: the weights' memory, which no other process shares (the
        # total also moves with the share of library pages as other processes come and go).
        assert slept["pss_anon_before"] - slept["pss_anon"] >= 0.9 * weights, slept
        assert cycle["pss_anon_before"] - cycle["pss_anon_asleep"] >= 0.9 * weights, cycle
        assert cycle["slept_again"]["released_bytes"] == 0


def test_wake_reports_reload_and_restore(sleep_run: dict[str, Any]) -> None:
    for cycle in sleep_run["cycles"][:-1]:
        woke = cycle["woke"]
        assert woke["woken"] and woke["reload_s"] > 0 and woke["restore_s"] > 0
        assert woke["wake_s"] >= woke["reload_s"]
        assert cycle["woke_again"]["woken"] is False


def test_a_request_to_a_sleeping_engine_wakes_it_and_is_answered(
    sleep_run: dict[str, Any],
) -> None:
    last = sleep_run["cycles"][-1]
    assert last["woke"] is None and last["outputs"] == sleep_run["reference"]
