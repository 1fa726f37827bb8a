"""Worker-side hooks for vLLM 0.32 on the CPU backend.

* ``CPUWorker.determine_available_memory`` answers the virtual capacity, so vLLM sizes its
  block table large without any of it being committed (and without reading free memory).
* ``CPUModelRunner.initialize_kv_cache`` marks the persistent (non-profiling) allocation;
  profiling / temporary caches keep vLLM's own allocation.
* ``CPUModelRunner.initialize_kv_cache_tensors`` validates our geometry *before* memory is
  touched, passes vLLM's ``kv_cache_allocation_context`` a mode that answers its one
  ``torch.zeros(n, int8)`` with the elastic backing, lets vLLM build its views, and then
  verifies every view against the geometry.
* ``CPUModelRunner.execute_model``, only with ``ELASTICKV_CHECK_COMMITS=1``: proves that
  the forward touched only pages committed before it (:mod:`.commit_check`).
* ``CPUWorker.elastickv_export_kv_pool`` (added) tells the engine core where the pool is, so
  a scheduler in another process can commit the pages this worker writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.worker.geometry_v032 import (
    geometry_from_config,
    single_tensor,
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


class BackingMode(TorchFunctionMode):
    """Answers exactly one ``torch.zeros(numel, dtype=int8)`` on the CPU with ``backing``."""

    def __init__(self, backing: torch.Tensor) -> None:
        super().__init__()
        self._backing = backing
        self.served = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.zeros and not self.served and self._is_kv_request(args, kwargs):
            self.served += 1
            return self._backing
        return func(*args, **kwargs)

    def _is_kv_request(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        size: Any = args[0] if len(args) == 1 else tuple(args)
        if isinstance(size, int):
            size = (size,)
        device = kwargs.get("device")
        return (
            kwargs.get("dtype") is torch.int8
            and tuple(size) == (self._backing.numel(),)
            and (device is None or torch.device(device).type == "cpu")
        )


def _plain_context(context: Any) -> None:
    if context is not None and not isinstance(context, contextlib.nullcontext):
        raise ElasticKVStartupError(
            f"vLLM asked to allocate the KV cache inside {type(context).__name__} (a KV "
            "connector memory pool?); elastickv cannot place the cache there"
        )


def install(config: ElasticConfig) -> None:

    def memory_wrapper(original: Callable[..., int]) -> Callable[..., int]:
        def determine_available_memory(self: Any) -> int:
            original(self)  # keeps vLLM's warm-up; its host-memory figure is not ours
            return advertised_capacity(self, config)

        return determine_available_memory

    def init_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_kv_cache(
            self: Any,
            kv_cache_config: Any,
            is_profiling: bool = False,
            kv_cache_allocation_context: Any = None,
        ) -> Any:
            if not is_profiling:
                _plain_context(kv_cache_allocation_context)
            setattr(self, PERSISTENT_MARK, not is_profiling)
            try:
                return original(
                    self,
                    kv_cache_config,
                    is_profiling,
                    kv_cache_allocation_context=kv_cache_allocation_context,
                )
            finally:
                setattr(self, PERSISTENT_MARK, False)

        return initialize_kv_cache

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
            tensor = single_tensor(kv_cache_config)
            group = group_index(kv_cache_config, tensor.layers[0])
            layout = self.cache_config.get_resolved_kv_cache_layout().name
            geometry = geometry_from_config(kv_cache_config, layout, kernel_block_sizes[group])
            size = int(tensor.size)
            placed = place(self, config, geometry, size)
            backing = placed.backing()
            mode = BackingMode(backing)
            views = original(self, kv_cache_config, kernel_block_sizes, mode)
            if mode.served != 1:
                raise ElasticKVStartupError(
                    "vLLM did not allocate its KV cache through torch.zeros(n, int8) inside "
                    "kv_cache_allocation_context; this vLLM build breaks the 0.32 contract"
                )
            verify_views(geometry, list(tensor.layers), views, backing)
            attach_placement(self, config, placed)
            return views

        return initialize_kv_cache_tensors

    install_runner_hooks(config, memory_wrapper, init_wrapper, tensors_wrapper)
