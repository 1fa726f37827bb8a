"""Prefill/decode disaggregation between two in-process engines (vLLM's ``LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), both ``ELASTICKV=1``, real NIXL over UCX loopback.

In-process the KV tensor lies on elastickv's strict range in the same process as the
scheduler (pages mapped and unmapped as blocks are backed and released), where the OpenAI
servers of ``test_vllm_plugin_v032_pd.py`` run the worker in a process of its own. Each engine
runs in its own process (``pd_engine.py``), on its own core:

1. the prompts on the prefill engine alone (the reference: one elastic engine);
2. the 8 prompts prefilled (``max_tokens=1``, ``do_remote_decode``) in one ``generate``, then
   decoded on the decode engine with the prefill outputs' ``kv_transfer_params``: equal to the
   reference, every block read from the prefiller (no recompute);
3. 4 other prompts prefilled, every committed page of the prefiller overwritten, then decoded:
   every output changes (the KV really crossed).

The budget holds all 8 prompts at once: an in-process prefiller's ``generate`` returns only
when every prompt is prefilled, so prompts that wait for pages held for the decoder would
wait for vLLM's lease to run out (``docs/pd.md``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_harness import BLOCK, MAX_TOKENS, engine_env, prompts, scramble_pool_of
from plugin_harness import PAGE, hermetic_env

from elastickv.ports import free_port
from elastickv.serve.pd import PREFILL_TRANSFER_PARAMS

pytestmark = pytest.mark.vllm

RUNNER = Path(__file__).with_name("pd_engine.py")
BUDGET = 128 * PAGE  # 4 MiB: the 8 prompts' blocks (about 2.5 MiB) held at once, and more
RECOMPUTED = "computing its prompt here instead of reading stale blocks"


class InProcessEngine:
    """A ``pd_engine.py`` process: one command line in, one JSON answer out."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log

    def read_answer(self) -> Any:
        assert self.proc.stdout is not None
        with self.log.with_suffix(".stdout").open("a") as sink:
            for line in self.proc.stdout:
                if line.startswith("RESULT "):
                    return json.loads(line.removeprefix("RESULT "))
                sink.write(line)
        raise AssertionError(
            f"the engine exited ({self.proc.wait()}):\n{self.log.read_text()[-4000:]}"
        )

    def generate(
        self, batch: list[str], max_tokens: int, transfer: list[Any] | None = None
    ) -> dict[str, Any]:
        assert self.proc.stdin is not None
        command = {"op": "generate", "prompts": batch, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps({**command, "transfer": transfer}) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = self.read_answer()
        return answer

    def prefill(self, batch: list[str]) -> list[dict[str, Any]]:
        """The first step of the exchange: the prompts' transfer parameters."""
        params = [dict(PREFILL_TRANSFER_PARAMS) for _ in batch]
        transfer: list[dict[str, Any]] = self.generate(batch, 1, params)["transfer"]
        return transfer

    def stop(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
        self.proc.stdin.flush()
        return self.proc.wait(timeout=60)


@contextlib.contextmanager
def in_process_engine(
    cache_root: Path, model: str, core: int, log: Path
) -> Iterator[InProcessEngine]:
    extra = {**engine_env(free_port(), core), "ELASTICKV_BUDGET": str(BUDGET)}
    env = hermetic_env(cache_root, extra, multiprocess=False)
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(RUNNER), model],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    engine = InProcessEngine(proc, log)
    try:
        yield engine
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def inproc(cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    logs = tmp_path_factory.mktemp("pd-inprocess-logs")
    same = prompts(8, "Request")
    other = prompts(4, "Query")
    result: dict[str, Any] = {}
    with (
        in_process_engine(cache_root, model, 0, logs / "prefill.log") as prefill,
        in_process_engine(cache_root, model, 1, logs / "decode.log") as decode,
    ):
        assert prefill.read_answer() == "READY" and decode.read_answer() == "READY"
        result["reference"] = prefill.generate(same + other, MAX_TOKENS)["ids"]
        result["prefilled"] = prefill.prefill(same)
        result["decoded"] = decode.generate(same, MAX_TOKENS, result["prefilled"])["ids"]
        transfer = prefill.prefill(other)
        result["scrambled_bytes"] = scramble_pool_of([prefill.proc.pid])
        result["scrambled"] = decode.generate(other, MAX_TOKENS, transfer)["ids"]
        result["exit"] = {"decode": decode.stop(), "prefill": prefill.stop()}
    result["logs"] = {p.name: p.read_text(errors="replace") for p in logs.iterdir()}
    return result


def test_in_process_pd_output_equals_one_engine(inproc: dict[str, Any]) -> None:
    reference = inproc["reference"][:8]
    assert all(len(ids) == MAX_TOKENS for ids in reference)
    for params in inproc["prefilled"]:
        # Several whole blocks per prompt, all of them read from the prefiller.
        assert len(params["remote_block_ids"][0]) >= 3, params
        assert params["remote_num_tokens"] > 2 * BLOCK, params
    assert inproc["decoded"] == reference
    assert RECOMPUTED not in inproc["logs"]["decode.log"]
    assert inproc["exit"] == {"decode": 0, "prefill": 0}


def test_in_process_scrambled_prefill_blocks_change_decode_output(
    inproc: dict[str, Any],
) -> None:
    assert inproc["scrambled_bytes"] > 0
    reference = inproc["reference"][8:]
    changed = sum(a != b for a, b in zip(inproc["scrambled"], reference, strict=True))
    assert changed == len(reference), (inproc["scrambled"], reference)
