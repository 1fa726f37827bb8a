"""An elastic engine's start on a stand-in CUDA platform, in one process of its own: what
``plugin.install`` binds, what the preflight refuses when vLLM builds the engine config, and
the model runners' placement through the installed hooks. Prints one JSON object.

The stand-in is vLLM's own platform object answering as CUDA (``_enum``) and saying that
the CUDA memory allocator sleep mode needs is there, as on a GPU; for the ROCm refusal, as
ROCm. It is set only in this process, after vLLM's modules are imported under the real CPU
platform (some call CUDA kernels at import when the platform says CUDA); no engine runs.

Usage: ``python cuda_standin.py MODEL_DIR LEDGER_DIR``.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

# Imported under the real platform (see the module docstring).
import vllm.engine.arg_utils
import vllm.v1.attention.backends.flash_attn
import vllm.v1.engine.core
import vllm.v1.worker.cpu_model_runner
import vllm.v1.worker.cpu_worker
import vllm.v1.worker.gpu.model_runner
import vllm.v1.worker.gpu_model_runner
import vllm.v1.worker.gpu_worker
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.platforms import current_platform
from vllm.platforms.interface import PlatformEnum

from elastickv.integrations.vllm import plugin
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.worker import worker

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def stand_in(platform: str) -> None:
    current_platform._enum = PlatformEnum[platform]
    current_platform.is_cumem_allocator_available = lambda: True


def wrapped(function: Any) -> bool:
    """Whether ``function`` is elastickv's wrapper around vLLM's own."""
    original = getattr(function, "__elastickv_original__", None)
    return original is not None and str(getattr(original, "__module__", "")).startswith("vllm")


def bindings() -> dict[str, bool]:
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.gpu import model_runner as v2

    v1_runner, v2_runner = gpu_model_runner.GPUModelRunner, v2.GPUModelRunner
    found = {
        "Worker.determine_available_memory": wrapped(gpu_worker.Worker.determine_available_memory),
        "gpu_worker.request_memory": wrapped(gpu_worker.request_memory),
        "V2 model_runner.init_kv_cache": wrapped(v2.init_kv_cache)
        and v2.init_kv_cache.__elastickv_original__ is attn_utils.init_kv_cache,
    }
    for name in ("initialize_kv_cache", "initialize_kv_cache_tensors", "execute_model"):
        found[f"V1 GPUModelRunner.{name}"] = wrapped(getattr(v1_runner, name))
    found["V1 GPUModelRunner.sample_tokens"] = wrapped(v1_runner.sample_tokens)
    for name in ("initialize_kv_cache", "execute_model"):
        found[f"V2 GPUModelRunner.{name}"] = wrapped(getattr(v2_runner, name))
    return found


def request_memory_on_a_shared_gpu() -> int:
    """vLLM's start-up check with only 10 of 100 GiB free (another engine holds the rest)."""
    from vllm.v1.worker import gpu_worker

    snapshot = types.SimpleNamespace(
        total_memory=100 << 30, free_memory=10 << 30, device_=torch.device("cuda:0")
    )
    cache = types.SimpleNamespace(gpu_memory_utilization=0.5)
    return int(gpu_worker.request_memory(snapshot, cache))


def engine_config(model: str, platform: str, **options: Any) -> dict[str, Any]:
    """vLLM's ``create_engine_config`` on the stand-in: the preflight's refusal, or the
    KV cache size it set."""
    stand_in(platform)
    try:
        config = vllm.engine.arg_utils.EngineArgs(model=model, **options).create_engine_config()
    except ElasticKVStartupError as exc:
        return {"refused": str(exc)}
    finally:
        stand_in("CUDA")
    return {"kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes}


class Layer:
    def __init__(self) -> None:
        self.kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache


def kv_cache_setup(v032: bool) -> tuple[Any, Any, list[int], Any]:
    """FlashAttention's KV cache config for two layers (bf16, 16-token blocks, 24 blocks)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    backend = AttentionBackendEnum.FLASH_ATTN.get_class()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    cache = types.SimpleNamespace(
        num_gpu_blocks_override=24, prefix_cache_retention_interval=None, cache_dtype="auto"
    )
    if v032:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        cache.get_resolved_kv_cache_layout = lambda: KVCacheLayout.LBNHC
    vllm_config = types.SimpleNamespace(
        cache_config=cache,
        attention_config=types.SimpleNamespace(hisparse_config=None),
        kv_transfer_config=None,
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="llama")),
        compilation_config=types.SimpleNamespace(
            static_forward_context={name: Layer() for name in NAMES}
        ),
    )
    group = KVCacheGroupSpec(NAMES, spec)
    config = get_kv_cache_config_from_groups(vllm_config, [group], available_memory=1 << 40)
    groups = [[AttentionGroup(backend, NAMES, spec, 0)]]
    return config, groups, prepare_kernel_block_sizes(config, groups), vllm_config


def placed(runner: Any, views: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    """What the runner's placement left: on elastic host storage, every view checked."""
    kv = worker.runner_kv(runner)
    if kv is None:
        return {"placed": False}
    try:
        worker.verify_views(kv.geometry, NAMES, views, kv.backing())
        storage = kv.backing().untyped_storage().data_ptr()
        bound = all(
            context[name].kv_cache is not None
            and context[name].kv_cache.untyped_storage().data_ptr() == storage
            for name in NAMES
        )
        return {"placed": True, "device": kv.device, "views_verified": True, "bound": bound}
    finally:
        kv.vmm_range.close()


def through_initialize_kv_cache(runner_class: Any, body: Callable[[Any], Any]) -> Any:
    """``body(runner)`` as the runner's ``initialize_kv_cache`` runs it, inside elastickv's
    wrapper of that method (which marks the persistent allocation and names the runner whose
    cache is being placed)."""
    runner = runner_class.__new__(runner_class)
    wrapper = worker.persistent_init_wrapper(lambda self, kv_cache_config: body(self))
    return runner, wrapper(runner, None)


def v2_placement(v032: bool) -> dict[str, Any]:
    """Model Runner V2's module-level ``init_kv_cache`` (the installed replacement) called
    by a V2 runner's ``initialize_kv_cache`` on CPU tensors."""
    from vllm.v1.worker.gpu import model_runner as v2

    config, groups, sizes, vllm_config = kv_cache_setup(v032)
    context = vllm_config.compilation_config.static_forward_context
    cpu = torch.device("cpu")

    def body(runner: Any) -> Any:
        if v032:
            flat = [group for groups_of in groups for group in groups_of]
            return v2.init_kv_cache(context, config, cpu, sizes, vllm_config, attn_groups=flat)
        return v2.init_kv_cache([], context, config, groups, cpu, "auto", sizes, vllm_config)

    runner, views = through_initialize_kv_cache(v2.GPUModelRunner, body)
    return placed(runner, views, context)


def v1_placement(v032: bool) -> dict[str, Any]:
    """Model Runner V1's ``initialize_kv_cache_tensors`` (wrapped) called by a V1 runner's
    ``initialize_kv_cache`` on CPU tensors."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    config, groups, sizes, vllm_config = kv_cache_setup(v032)
    context = vllm_config.compilation_config.static_forward_context

    def body(runner: Any) -> Any:
        runner.device = torch.device("cpu")
        runner.cache_config = vllm_config.cache_config
        runner.kv_cache_config = config
        runner.shared_kv_cache_layers = {}
        runner.runner_only_attn_layers = set()
        runner.model_config = vllm_config.model_config
        runner.attn_groups = groups
        runner.speculative_config = None
        runner.compilation_config = vllm_config.compilation_config
        runner.kv_caches = []
        return runner.initialize_kv_cache_tensors(config, sizes)

    runner, views = through_initialize_kv_cache(GPUModelRunner, body)
    return placed(runner, views, context)


def main(model: str, ledger_dir: str) -> None:
    stand_in("CUDA")
    contract = plugin.install(ElasticConfig(ledger_dir=ledger_dir))
    v032 = contract.value == "0.32"
    report: dict[str, Any] = {
        "contract": contract.value,
        "bindings": bindings(),
        "request_memory": request_memory_on_a_shared_gpu(),
        "rocm": engine_config(model, "ROCM"),
        "sleep_mode": engine_config(model, "CUDA", enable_sleep_mode=True),
        "cpu_backend_on_cuda": engine_config(model, "CUDA", attention_backend="CPU_ATTN"),
        "flash_attn_fp8": engine_config(
            model, "CUDA", attention_backend="FLASH_ATTN", kv_cache_dtype="fp8"
        ),
    }
    # The worker builds the cache under the engine's config (0.28's stride orders read the
    # KV connector's layout from it).
    with set_current_vllm_config(VllmConfig()):
        report["v1"] = v1_placement(v032)
        report["v2"] = v2_placement(v032)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
