"""An elastic engine's start on a stand-in CUDA platform, in one process of its own: what
``plugin.install`` binds, what the preflight refuses when vLLM builds the engine config, the
model runners' placement through the installed hooks, and sleep through vLLM's own sleep
mode (its real ``Worker.sleep`` / ``wake_up`` over a recording sleep-mode backend, its real
memory-pool choice over a recording allocator). Prints one JSON object.

The stand-in is vLLM's own platform object answering as CUDA (``_enum``) and saying that
the CUDA memory allocator sleep mode needs is there, as on a GPU; for the ROCm refusal, as
ROCm. It is set only in this process, after vLLM's modules are imported under the real CPU
platform (some call CUDA kernels at import when the platform says CUDA); no engine runs.

Usage: ``python cuda_standin.py MODEL_DIR LEDGER_DIR``.
"""

from __future__ import annotations

import contextlib
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
from elastickv.integrations.vllm.worker import weights_sleep, worker

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
    for name in ("_maybe_get_memory_pool_context", "execute_dummy_batch"):
        found[f"Worker.{name}"] = wrapped(getattr(gpu_worker.Worker, name))
    if hasattr(v1_runner, "post_kv_cache_wake_up"):
        found["V1 GPUModelRunner.post_kv_cache_wake_up"] = wrapped(v1_runner.post_kv_cache_wake_up)
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
    return {
        "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
        "cumem_allocator": bool(getattr(config.model_config, "enable_cumem_allocator", False)),
    }


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


class RecordingAllocator:
    """vLLM's CuMem allocator as far as the worker uses it: the pools asked for, by tag, and
    one ``weights`` allocation of 4 KiB (what a sleep reports released)."""

    def __init__(self) -> None:
        self.tags: list[str] = []
        self.pointer_to_data = {1: types.SimpleNamespace(tag="weights", handle=(0, 4096))}

    def get_current_usage(self) -> int:
        return 0

    def use_memory_pool(self, tag: str) -> Any:
        self.tags.append(tag)
        return contextlib.nullcontext()


def memory_pools() -> dict[str, Any]:
    """The GPU worker's pool for each tag with the CuMem allocator on (sleep mode): vLLM's
    for the weights and runtime state, none for the KV cache (elastickv's own range)."""
    from vllm.v1.worker import gpu_worker

    allocator = RecordingAllocator()
    gpu_worker.get_mem_allocator_instance = lambda: allocator
    host = gpu_worker.Worker.__new__(gpu_worker.Worker)
    model_config = types.SimpleNamespace(enable_cumem_allocator=True, enable_sleep_mode=True)
    host.vllm_config = types.SimpleNamespace(model_config=model_config)
    kinds = {}
    for tag in ("weights", "kv_cache", "runtime"):
        kinds[tag] = type(gpu_worker.Worker._maybe_get_memory_pool_context(host, tag)).__name__
    return {"context": kinds, "pools_asked": allocator.tags}


class RecordingBackend:
    """vLLM's sleep-mode backend as the worker drives it: what was asked, and its state."""

    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls
        self.status = "RUNNING"

    def suspend(self, level: int = 1) -> None:
        self.calls.append(["suspend", level])
        self.status = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self.calls.append(["resume", tags])
        self.status = "RUNNING"

    def state(self) -> str:
        return self.status


class Runner:
    """A model runner holding a model with a parameter and a buffer (a level-2 sleep keeps
    the buffers in host memory; the reload restores the parameters)."""

    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls
        self.buffer = torch.full((2,), 7.0)
        self.model = torch.nn.Linear(2, 2)
        self.model.register_buffer("mean", self.buffer)

    def get_model(self) -> torch.nn.Module:
        return self.model

    def get_draft_model(self) -> None:
        return None

    def reload_weights(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(["reload_weights", float(self.buffer[0])])


def sleeping_worker(calls: list[Any], *, sleep_mode: bool = True) -> Any:
    """vLLM's GPU ``Worker`` with what its sleep and wake read, and a memory reading that
    rises by 1 GiB per sleep (the weights released)."""
    from vllm.v1.worker import gpu_worker

    host = gpu_worker.Worker.__new__(gpu_worker.Worker)
    model_config = types.SimpleNamespace(
        enable_sleep_mode=sleep_mode,
        enable_nccl_comm_suspend=False,
        sleep_preserve_parameter_names=[],
    )
    host.vllm_config = types.SimpleNamespace(model_config=model_config)
    host.model_config = model_config
    host.model_runner = Runner(calls)
    host._sleep_mode_backend = RecordingBackend(calls)
    host._sleep_saved_buffers = {}
    host._sleep_saved_parameters = {}
    host._sleep_saved_draft_buffers = {}
    return host


def sleep_through_vllm() -> dict[str, Any]:
    """The sleep and wake RPCs on the stand-in GPU worker, over vLLM's real ``Worker.sleep``
    and ``wake_up``: each level, idempotence, a wake by a step, and the refusals."""
    from vllm.v1.worker import gpu_worker

    free = [10 << 30]

    def memory_info(device: Any = None) -> tuple[int, int]:
        return free[0], 80 << 30

    torch.accelerator.synchronize = lambda *a, **k: None
    torch.accelerator.get_memory_info = memory_info
    torch.accelerator.is_available = lambda: False
    allocator = RecordingAllocator()
    import vllm.device_allocator

    vllm.device_allocator.get_mem_allocator_instance = lambda: allocator
    Worker = gpu_worker.Worker
    out: dict[str, Any] = {}
    for level in (1, 2):
        calls: list[Any] = []
        host = sleeping_worker(calls)
        free[0] = 10 << 30
        original_suspend = host._sleep_mode_backend.suspend

        def suspend(lvl: int = 1, _orig: Any = original_suspend, _host: Any = host) -> None:
            _orig(lvl)
            free[0] += 1 << 30
            if lvl == 2:  # discarded (level 1 copies the pool to host memory and back)
                _host.model_runner.buffer.zero_()

        host._sleep_mode_backend.suspend = suspend
        first = Worker.elastickv_sleep_weights(host, level=level)
        again = Worker.elastickv_sleep_weights(host, level=level)
        woke = Worker.elastickv_wake_weights(host)
        woke_again = Worker.elastickv_wake_weights(host)
        Worker.elastickv_sleep_weights(host, level=level)
        weights_sleep.wake_if_asleep(host.model_runner)  # what a step does first
        out[f"level{level}"] = {
            "calls": calls,
            "first": first,
            "again": again,
            "woke": {k: woke[k] for k in ("woken", "level")},
            "woke_again": woke_again["woken"],
            "buffer_after": float(host.model_runner.buffer[0]),
        }
    # A neighbour committed during the sleep: free memory fell, vLLM's assert fires after
    # the weights were released.
    calls = []
    host = sleeping_worker(calls)
    free[0] = 10 << 30
    original = host._sleep_mode_backend.suspend

    def suspend_while_others_commit(lvl: int = 1) -> None:
        original(lvl)
        free[0] -= 1 << 30

    host._sleep_mode_backend.suspend = suspend_while_others_commit
    out["neighbour_committed"] = Worker.elastickv_sleep_weights(host, level=1)
    refusals: dict[str, str | None] = {}
    cases = {
        "no_sleep_mode": (sleeping_worker([], sleep_mode=False), 1),
        "level_3": (sleeping_worker([]), 3),
        "vllm_asleep": (sleeping_worker([]), 1),
    }
    cases["vllm_asleep"][0]._sleep_mode_backend.status = "SUSPENDED"
    for name, (host, level) in cases.items():
        try:
            Worker.elastickv_sleep_weights(host, level=level)
            refusals[name] = None
        except RuntimeError as exc:
            refusals[name] = str(exc)
    out["refusals"] = refusals
    dummy: list[str] = []
    host = sleeping_worker(dummy)
    Worker.elastickv_sleep_weights(host, level=1)
    worker.dummy_batch_wrapper(lambda self: dummy.append("dummy batch"))(host)
    out["dummy_batch"] = [c if isinstance(c, str) else c[0] for c in dummy]
    return out


def post_wake_keeps_the_kv(v032: bool) -> dict[str, Any] | None:
    """vLLM 0.28's wake that names ``kv_cache`` on an fp8 KV cache: the elastic cache is not
    zeroed, the scales are reset."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not hasattr(GPUModelRunner, "post_kv_cache_wake_up"):
        return None
    layer = Attention.__new__(Attention)
    torch.nn.Module.__init__(layer)
    layer._k_scale = torch.zeros(1)
    layer._v_scale = torch.zeros(1)
    out = {}
    for elastic in (False, True):
        runner = GPUModelRunner.__new__(GPUModelRunner)
        runner.cache_config = types.SimpleNamespace(cache_dtype="fp8")
        runner.compilation_config = types.SimpleNamespace(static_forward_context={"l": layer})
        cache = torch.ones(4)
        runner.kv_caches = [cache]
        if elastic:
            setattr(runner, worker._KV, object())
        runner.post_kv_cache_wake_up()
        out["elastic" if elastic else "native"] = {
            "kv": float(cache.sum()),
            "kv_caches_kept": runner.kv_caches == [cache],
            "k_scale": float(layer._k_scale[0]),
        }
        layer._k_scale.zero_()
    return out


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
    report["memory_pools"] = memory_pools()
    report["sleep"] = sleep_through_vllm()
    report["post_wake"] = post_wake_keeps_the_kv(v032)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
