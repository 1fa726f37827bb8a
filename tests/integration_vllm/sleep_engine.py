"""One in-process vLLM engine (0.28 or 0.32) whose weights sleep and wake while it runs,
driven by :mod:`sleep_tests`.

Usage: ``python sleep_engine.py MODEL_DIR CYCLES``; elastickv's settings come from the
environment. Greedy outputs of ``PROMPTS`` first (the reference), then ``CYCLES`` times: the
sleep RPC (and a second one, which must release nothing), the engine's memory, then either the
wake RPC (and a second one, which must do nothing) or, in the last cycle, a request sent to the
sleeping engine; then the outputs again. Prints one JSON document.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PROMPTS = ["The quick brown fox", "Memory is reserved up front", "你好，世界！", "12 + 7 ="]
MAX_TOKENS = 16


def main() -> None:
    from vllm import LLM, SamplingParams

    from elastickv.integrations.vllm.worker.weights_sleep import (
        SLEEP_METHOD,
        WAKE_METHOD,
        process_pss,
    )

    model, cycles = sys.argv[1], int(sys.argv[2])
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        block_size=32,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate() -> list[list[int]]:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def pss() -> int:
        """The anonymous part of this process's PSS, where the weights live (other processes
        starting or exiting move the share of the libraries' pages in the total)."""
        anon = process_pss("Pss_Anon")
        assert anon is not None, "/proc/self/smaps_rollup has no Pss_Anon"
        return anon

    result: dict[str, Any] = {"reference": generate(), "cycles": []}
    for cycle in range(cycles):
        asleep_request = cycle == cycles - 1
        before = pss()
        slept = llm.collective_rpc(SLEEP_METHOD)[0]
        again = llm.collective_rpc(SLEEP_METHOD)[0]
        asleep = pss()
        start = time.perf_counter()
        woke = noop = None
        if not asleep_request:
            woke = llm.collective_rpc(WAKE_METHOD)[0]
            noop = llm.collective_rpc(WAKE_METHOD)[0]
        outputs = generate()
        result["cycles"].append(
            {
                "slept": slept,
                "slept_again": again,
                "woke": woke,
                "woke_again": noop,
                "pss_anon_before": before,
                "pss_anon_asleep": asleep,
                "wake_and_answer_s": time.perf_counter() - start,
                "outputs": outputs,
            }
        )
    print(json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
