"""Worker-side hooks for vLLM 0.32 (the standardized KV cache layout), both model runners.

vLLM 0.32 allocates the whole KV cache as ONE ``torch.zeros(n, int8)`` inside the
``kv_cache_allocation_context`` it is given, then builds every layer's view with
``as_strided`` from the ``KVCacheTensor``'s strides and the resolved layout. Both runners do
so through that one function, each from its own place:

* Model Runner V1 (``GPUModelRunner.initialize_kv_cache_tensors``; vLLM's CPU runner
  inherits it) — wrapped;
* Model Runner V2 (the module-level ``init_kv_cache`` its model runner calls, the default on
  CUDA when Triton is present) — replaced by a wrapper in that module.

Each builds a ``KVCacheGeometry`` from vLLM's config *before* memory is touched, places the
worker's own elastic range (:func:`~.worker.place`), passes a mode that answers the one
``torch.zeros`` with it, lets vLLM build its views and verifies every view against the
geometry. The CPU worker's ``determine_available_memory`` keeps vLLM's warm-up and answers
the virtual capacity (vLLM's figure reads free host memory, which colocated engines share).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.hooks import wrap_method
from elastickv.integrations.vllm.worker.capacity import advertised_capacity
from elastickv.integrations.vllm.worker.geometry_v032 import geometry_from_config, single_tensor
from elastickv.integrations.vllm.worker.worker import (
    INITIALISING,
    PERSISTENT_MARK,
    BackingMode,
    attach_placement,
    group_index,
    install_runner_hooks,
    place,
    verify_views,
)

_V2_MARK = "__elastickv_original__"


def place_single_backing(
    config: ElasticConfig,
    runner: Any,
    kv_cache_config: Any,
    layout: str,
    kernel_block_sizes: list[int],
    device: Any,
    allocate: Callable[[BackingMode], dict[str, Any]],
    *,
    memory_device: Any = None,
) -> dict[str, Any]:
    """The 0.32 placement for either runner: geometry first, then the worker's range, then
    vLLM's own allocation (``allocate(mode)``) answered with it, then every view checked.

    ``device`` is where vLLM allocates (its ``torch.zeros(..., device=device)`` is the call
    answered); ``memory_device`` is whose memory holds the range, ``device`` unless given (a
    host range under vLLM's ``cuda`` device runs vLLM's GPU code on CPU tensors, as the
    contract tests do)."""
    tensor = single_tensor(kv_cache_config)
    group = group_index(kv_cache_config, tensor.layers[0])
    geometry = geometry_from_config(kv_cache_config, layout, kernel_block_sizes[group])
    size = int(tensor.size)
    placed = place(config, geometry, size, device if memory_device is None else memory_device)
    try:
        backing = placed.backing()
        mode = BackingMode(backing, device)
        views = allocate(mode)
        if mode.served != 1:
            raise ElasticKVStartupError(
                "vLLM did not allocate its KV cache through torch.zeros(n, int8) inside "
                "kv_cache_allocation_context; this vLLM build breaks the 0.32 contract"
            )
        verify_views(geometry, list(tensor.layers), views, backing)
    except BaseException:
        placed.vmm_range.close()
        raise
    attach_placement(runner, config, placed)
    return views


def install(config: ElasticConfig) -> None:

    def cpu_memory_wrapper(original: Callable[..., int]) -> Callable[..., int]:
        def determine_available_memory(self: Any) -> int:
            # vLLM's own version warms the model up, then reads free host memory (which
            # colocated engines share); only the warm-up is wanted.
            if getattr(self, "_should_warm_up_model", lambda: True)():
                self.model_runner.warming_up_model()
            return advertised_capacity(self, config)

        return determine_available_memory

    def tensors_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_kv_cache_tensors(
            self: Any,
            kv_cache_config: Any,
            kernel_block_sizes: list[int],
            kv_cache_allocation_context: Any = None,
        ) -> Any:
            if not getattr(self, PERSISTENT_MARK, False):
                return original(
                    self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context
                )
            return place_single_backing(
                config,
                self,
                kv_cache_config,
                self.cache_config.get_resolved_kv_cache_layout().name,
                kernel_block_sizes,
                self.device,
                lambda mode: original(self, kv_cache_config, kernel_block_sizes, mode),
            )

        return initialize_kv_cache_tensors

    def v2_init_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def init_kv_cache(
            forward_context: dict[str, Any],
            kv_cache_config: Any,
            device: Any,
            kernel_block_sizes: list[int],
            vllm_config: Any,
            kv_cache_allocation_context: Any = None,
            **kwargs: Any,
        ) -> dict[str, Any]:
            runner = INITIALISING.get(None)
            if runner is None:
                native: dict[str, Any] = original(
                    forward_context, kv_cache_config, device, kernel_block_sizes,
                    vllm_config, kv_cache_allocation_context, **kwargs,
                )  # fmt: skip
                return native
            if vllm_config.attention_config.hisparse_config is not None:
                raise ElasticKVStartupError(
                    "elastickv cannot place a HiSparse KV cache (it allocates its own "
                    "tensors); unset ELASTICKV or the HiSparse attention config"
                )

            def allocate(mode: BackingMode) -> dict[str, Any]:
                views: dict[str, Any] = original(
                    forward_context, kv_cache_config, device, kernel_block_sizes,
                    vllm_config, mode, **kwargs,
                )  # fmt: skip
                return views

            layout = vllm_config.cache_config.get_resolved_kv_cache_layout().name
            return place_single_backing(
                config, runner, kv_cache_config, layout, kernel_block_sizes, device, allocate
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
