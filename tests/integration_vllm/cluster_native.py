"""Native vLLM's answers for the cluster test: each model in turn, in this process (no
elastickv), every prompt computed alone, greedy.

Usage: ``python cluster_native.py SPEC``; SPEC (JSON) is ``{"models": {name: {"path": ...,
"dtype": ...}}, "prompts": [[token ids], ...], "max_tokens": N, "engine": {LLM keyword
arguments}}``. Prints one JSON line: ``{name: [generated token ids per prompt]}``.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    answers: dict[str, Any] = {}
    for name, model in spec["models"].items():
        llm = LLM(model=model["path"], dtype=model["dtype"], **spec["engine"])
        answers[name] = [
            list(llm.generate(TokensPrompt(prompt_token_ids=ids), params)[0].outputs[0].token_ids)
            for ids in spec["prompts"]
        ]
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    sys.stdout.write(json.dumps(answers) + "\n")


if __name__ == "__main__":
    main()
