"""One in-process vLLM 0.32 engine of a P/D pair (``LLM``, run with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, worker and KV cache in this process), driven
over stdin/stdout by ``test_vllm_plugin_v032_pd_inprocess.py``.

Usage: ``python pd_engine.py MODEL_DIR``; the engine's settings (NIXL side channel, elastickv)
come from the environment. It prints ``READY`` then answers one JSON line per command line:

* ``{"op": "generate", "prompts": [...], "max_tokens": N, "transfer": [...] | null}``: greedy
  outputs, each request with its own ``kv_transfer_params`` (``transfer[i]``) if given;
  answers ``{"ids": [[...]], "transfer": [...]}`` (the outputs' ``kv_transfer_params``);
* ``{"op": "exit"}``: shuts the engine down and exits.

Between commands the engine does not step: a decoder's NIXL reads of this engine's blocks
need nothing from it (UCX reads them from this process's memory).
"""

from __future__ import annotations

import json
import sys
from typing import Any

RESULT = "RESULT "


def answer(payload: Any) -> None:
    sys.stdout.write(RESULT + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main() -> None:
    from pd_harness import BLOCK, KV_TRANSFER
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=sys.argv[1],
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=BLOCK,
        seed=0,
        gpu_memory_utilization=0.2,
        kv_transfer_config=KVTransferConfig(**json.loads(KV_TRANSFER)),
    )
    answer("READY")
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            break
        prompts: list[str] = command["prompts"]
        transfer = command.get("transfer") or [None] * len(prompts)
        params = [
            SamplingParams(
                temperature=0,
                max_tokens=command["max_tokens"],
                ignore_eos=True,
                extra_args=None if t is None else {"kv_transfer_params": t},
            )
            for t in transfer
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        answer(
            {
                "ids": [list(out.outputs[0].token_ids) for out in outputs],
                "transfer": [out.kv_transfer_params for out in outputs],
            }
        )
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
