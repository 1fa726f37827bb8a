"""Worker-side hooks for vLLM 0.28–0.31 (the 0.28 KV-cache contract), both model runners.

Under this contract vLLM calls ``torch.zeros(size, int8)`` once per ``KVCacheTensor`` (one
per layer) and builds each layer's view itself (``view(permuted shape).permute(inverse)``):

* Model Runner V1 in ``GPUModelRunner.initialize_kv_cache_tensors`` (vLLM's CPU runner
  inherits it) — wrapped;
* Model Runner V2 in the module-level ``init_kv_cache`` its model runner calls — replaced by
  a wrapper in that module.

Both plan the per-layer geometry *before* memory is touched, answer vLLM's per-layer
``torch.zeros`` calls, in order, with consecutive slices of ONE elastic range — layer ``l``
at ``l × layer bytes`` — let vLLM build its views, and verify every view against
``layer_views(geometry)``. The CPU worker's ``determine_available_memory`` keeps vLLM's
warm-up and answers the virtual capacity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.hooks import wrap_method
from elastickv.integrations.vllm.worker.capacity import advertised_capacity
from elastickv.integrations.vllm.worker.geometry_v028 import (
    backend_of,
    per_layer_tensors,
    plan_from_config,
)
from elastickv.integrations.vllm.worker.worker import (
    INITIALISING,
    PERSISTENT_MARK,
    LayerBackingMode,
    attach_placement,
    group_index,
    install_runner_hooks,
    place,
    verify_views,
)

_V2_MARK = "__elastickv_original__"


def _no_connector() -> None:
    """A KV connector may ask for the cross-layer backing or register the caches elsewhere;
    elastickv does not place those yet."""
    try:
        from vllm.distributed.kv_transfer import has_kv_transfer_group
    except ImportError:
        return
    if has_kv_transfer_group():
        raise ElasticKVStartupError(
            "elastickv does not support a KV connector with vLLM 0.28 (it may request the "
            "cross-layer KV backing); unset ELASTICKV or the KV transfer config"
        )


def place_per_layer(
    config: ElasticConfig,
    runner: Any,
    kv_cache_config: Any,
    attn_groups: Any,
    kernel_block_sizes: list[int],
    device: Any,
    allocate: Callable[[LayerBackingMode], dict[str, Any]],
    *,
    memory_device: Any = None,
) -> dict[str, Any]:
    """The 0.28 placement for either runner: the per-layer plan first, then the worker's
    range, then vLLM's own allocation (``allocate(mode)``) answered with consecutive slices of
    it, then every view checked. ``device`` and ``memory_device`` are as for 0.32's
    :func:`~.worker_v032.place_single_backing`."""
    _no_connector()
    layers, _ = per_layer_tensors(kv_cache_config)
    backend = backend_of(attn_groups, layers)
    group = group_index(kv_cache_config, layers[0])
    kbs = kernel_block_sizes[group] if group < len(kernel_block_sizes) else None
    plan = plan_from_config(kv_cache_config, backend, kbs)
    memory = device if memory_device is None else memory_device
    placed = place(config, plan.geometry, plan.size_bytes, memory)
    try:
        backing = placed.backing()
        slices = [
            backing[i * plan.layer_bytes : (i + 1) * plan.layer_bytes]
            for i in range(len(plan.layers))
        ]
        mode = LayerBackingMode(slices, device)
        with mode:
            views = allocate(mode)
        if mode.served != len(slices):
            raise ElasticKVStartupError(
                f"vLLM allocated {mode.served} of its {len(slices)} per-layer KV tensors "
                "through torch.zeros(size, int8); this vLLM build breaks the 0.28 contract"
            )
        verify_views(plan.geometry, list(plan.layers), views, backing)
    except BaseException:
        placed.vmm_range.close()
        raise
    attach_placement(runner, config, placed)
    return views


def install(config: ElasticConfig) -> None:

    def cpu_memory_wrapper(original: Callable[..., int]) -> Callable[..., int]:
        def determine_available_memory(self: Any) -> int:
            # vLLM's own version warms the model up, then reads free host memory; only the
            # warm-up is wanted (the figure would count colocated engines).
            self.model_runner.warming_up_model()
            return advertised_capacity(self, config)

        return determine_available_memory

    def tensors_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_kv_cache_tensors(
            self: Any, kv_cache_config: Any, kernel_block_sizes: list[int]
        ) -> Any:
            if not getattr(self, PERSISTENT_MARK, False):
                return original(self, kv_cache_config, kernel_block_sizes)
            return place_per_layer(
                config,
                self,
                kv_cache_config,
                self.attn_groups,
                kernel_block_sizes,
                self.device,
                lambda mode: original(self, kv_cache_config, kernel_block_sizes),
            )

        return initialize_kv_cache_tensors

    def v2_init_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def init_kv_cache(
            runner_kv_caches: Any,
            forward_context: dict[str, Any],
            kv_cache_config: Any,
            attn_groups: Any,
            device: Any,
            cache_dtype: str,
            kernel_block_sizes: list[int],
            vllm_config: Any,
        ) -> dict[str, Any]:
            def call(mode: LayerBackingMode | None = None) -> dict[str, Any]:
                result: dict[str, Any] = original(
                    runner_kv_caches, forward_context, kv_cache_config, attn_groups, device,
                    cache_dtype, kernel_block_sizes, vllm_config,
                )  # fmt: skip
                return result

            runner = INITIALISING.get(None)
            if runner is None:
                return call()
            return place_per_layer(
                config, runner, kv_cache_config, attn_groups, kernel_block_sizes, device, call
            )

        return init_kv_cache

    def contract_hooks() -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        wrap_method(GPUModelRunner, "initialize_kv_cache_tensors", tensors_wrapper)
        try:
            from vllm.v1.worker.gpu import model_runner as v2
        except ImportError:
            return
        if getattr(v2.init_kv_cache, _V2_MARK, None) is None:
            wrapped = v2_init_wrapper(v2.init_kv_cache)
            setattr(wrapped, _V2_MARK, v2.init_kv_cache)
            v2.init_kv_cache = wrapped

    install_runner_hooks(config, cpu_memory_wrapper, contract_hooks)
