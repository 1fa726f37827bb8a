"""Worker-side hooks for vLLM 0.28–0.31 on the CPU backend (the 0.28 KV-cache contract).

* ``CPUWorker.determine_available_memory`` keeps vLLM's warm-up and answers the virtual
  capacity, so vLLM sizes its block table large without committing it (and without reading
  free memory, which colocated engines would see each other in).
* ``CPUModelRunner.initialize_kv_cache`` marks the persistent (non-profiling) allocation;
  profiling / temporary caches keep vLLM's own allocation.
* ``CPUModelRunner.initialize_kv_cache_tensors`` plans the per-layer geometry *before* memory
  is touched, answers vLLM's per-layer ``torch.zeros(size, int8)`` calls (one per
  ``KVCacheTensor``, in order) with consecutive slices of ONE elastic range — layer ``l`` at
  ``l × layer bytes`` — lets vLLM build its views (``view(permuted).permute(inverse)``), and
  verifies every view against ``layer_views(geometry)``.
* ``CPUModelRunner.execute_model``, only with ``ELASTICKV_CHECK_COMMITS=1``: the commit check.
* ``CPUWorker.elastickv_export_kv_pool`` (added) for the engine core (same RPC as 0.32).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.worker.geometry_v028 import (
    backend_of,
    per_layer_tensors,
    plan_from_config,
)
from elastickv.integrations.vllm.worker.worker import (
    PERSISTENT_MARK,
    advertised_capacity,
    attach_placement,
    group_index,
    install_runner_hooks,
    place,
    verify_views,
)


class LayerBackingMode(TorchFunctionMode):
    """Answers vLLM's per-layer ``torch.zeros(size, dtype=int8)`` calls on the CPU, in order,
    with ``slices`` (each exactly ``size`` bytes); every other call runs unchanged."""

    def __init__(self, slices: list[torch.Tensor]) -> None:
        super().__init__()
        self._slices = slices
        self.served = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.zeros and self.served < len(self._slices):
            target = self._slices[self.served]
            if self._is_kv_request(target, args, kwargs):
                self.served += 1
                return target
        return func(*args, **kwargs)

    @staticmethod
    def _is_kv_request(
        target: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> bool:
        size: Any = args[0] if len(args) == 1 else tuple(args)
        if isinstance(size, int):
            size = (size,)
        device = kwargs.get("device")
        return (
            kwargs.get("dtype") is torch.int8
            and tuple(size) == (target.numel(),)
            and (device is None or torch.device(device).type == "cpu")
        )


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


def install(config: ElasticConfig) -> None:

    def memory_wrapper(original: Callable[..., int]) -> Callable[..., int]:
        def determine_available_memory(self: Any) -> int:
            # vLLM's own version warms the model up, then reads free host memory; only the
            # warm-up is wanted (the figure would count colocated engines).
            self.model_runner.warming_up_model()
            return advertised_capacity(self, config)

        return determine_available_memory

    def init_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_kv_cache(self: Any, kv_cache_config: Any, is_profiling: bool = False) -> Any:
            setattr(self, PERSISTENT_MARK, not is_profiling)
            try:
                return original(self, kv_cache_config, is_profiling)
            finally:
                setattr(self, PERSISTENT_MARK, False)

        return initialize_kv_cache

    def tensors_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_kv_cache_tensors(
            self: Any, kv_cache_config: Any, kernel_block_sizes: list[int]
        ) -> Any:
            if not getattr(self, PERSISTENT_MARK, False):
                return original(self, kv_cache_config, kernel_block_sizes)
            _no_connector()
            layers, _ = per_layer_tensors(kv_cache_config)
            backend = backend_of(self.attn_groups, layers)
            group = group_index(kv_cache_config, layers[0])
            kbs = kernel_block_sizes[group] if group < len(kernel_block_sizes) else None
            plan = plan_from_config(kv_cache_config, backend, kbs)
            placed = place(self, config, plan.geometry, plan.size_bytes)
            backing = placed.backing()
            slices = [
                backing[i * plan.layer_bytes : (i + 1) * plan.layer_bytes]
                for i in range(len(plan.layers))
            ]
            mode = LayerBackingMode(slices)
            with mode:
                views = original(self, kv_cache_config, kernel_block_sizes)
            if mode.served != len(slices):
                raise ElasticKVStartupError(
                    f"vLLM allocated {mode.served} of its {len(slices)} per-layer KV tensors "
                    "through torch.zeros(size, int8); this vLLM build breaks the 0.28 contract"
                )
            verify_views(plan.geometry, list(plan.layers), views, backing)
            attach_placement(self, config, placed)
            return views

        return initialize_kv_cache_tensors

    install_runner_hooks(config, memory_wrapper, init_wrapper, tensors_wrapper)
