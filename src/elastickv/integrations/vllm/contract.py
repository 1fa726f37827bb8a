"""Which vLLM KV-cache contract the installed vLLM offers: capability first, version as a guard.

Anything we have not verified fails start-up with the version and the supported list; a
silent fallback to native allocation would hide that the engine is not elastic.
"""

from __future__ import annotations

import inspect

from elastickv.geometry import Contract
from elastickv.integrations.vllm.errors import ElasticKVStartupError

# vLLM release series -> the contract this build of the plugin implements for it.
SUPPORTED_SERIES: dict[str, Contract] = {
    "0.32": Contract.V032,
    "0.28": Contract.V028,
    "0.29": Contract.V028,
    "0.30": Contract.V028,
    "0.31": Contract.V028,
}


def _supported_text() -> str:
    """``0.32.x (0.32 contract), 0.28.x–0.31.x (0.28 contract)``: one entry per contract."""
    by_contract: dict[Contract, list[str]] = {}
    for name, contract in SUPPORTED_SERIES.items():
        by_contract.setdefault(contract, []).append(name)
    parts = []
    for contract, names in by_contract.items():
        span = f"{names[0]}.x" if len(names) == 1 else f"{names[0]}.x–{names[-1]}.x"
        parts.append(f"{span} ({contract.value} contract)")
    return ", ".join(parts)


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _series(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _has_v032_contract() -> bool:
    """One flat backing + named layouts + an allocation context (vLLM PR #51718)."""
    try:
        from vllm.v1 import kv_cache_interface, kv_cache_layout
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    params = inspect.signature(GPUModelRunner.initialize_kv_cache_tensors).parameters
    return (
        hasattr(kv_cache_interface, "create_kv_cache_views")
        and hasattr(kv_cache_interface.KVCacheTensor, "__dataclass_fields__")
        and {"layer_stride", "block_stride"}
        <= set(kv_cache_interface.KVCacheTensor.__dataclass_fields__)
        and hasattr(kv_cache_layout, "KVCacheLayout")
        and "kv_cache_allocation_context" in params
    )


def _has_v028_contract() -> bool:
    """Per-backend ``get_kv_cache_shape``/``get_kv_cache_stride_order``, one ``torch.zeros``
    per ``KVCacheTensor`` (``shared_by``), views built by ``_reshape_kv_cache_tensors``."""
    try:
        from vllm.v1 import kv_cache_interface
        from vllm.v1.attention.backend import AttentionBackend
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    fields = set(getattr(kv_cache_interface.KVCacheTensor, "__dataclass_fields__", {}))
    params = list(inspect.signature(GPUModelRunner.initialize_kv_cache_tensors).parameters)
    return (
        hasattr(AttentionBackend, "get_kv_cache_shape")
        and hasattr(AttentionBackend, "get_kv_cache_stride_order")
        and {"size", "shared_by"} <= fields
        and "layer_stride" not in fields
        and params == ["self", "kv_cache_config", "kernel_block_sizes"]
        and hasattr(GPUModelRunner, "_allocate_kv_cache_tensors")
        and hasattr(GPUModelRunner, "_reshape_kv_cache_tensors")
        and hasattr(CPUModelRunner, "initialize_kv_cache")
    )


def detect_contract(version: str | None = None) -> Contract:
    """The contract to apply, or :class:`ElasticKVStartupError` naming what is supported."""
    version = installed_version() if version is None else version
    supported = _supported_text()
    contract = SUPPORTED_SERIES.get(_series(version))
    if contract is None:
        raise ElasticKVStartupError(
            f"elastickv does not support vLLM {version}; supported: {supported}. "
            "Unset ELASTICKV to run vLLM without elastickv."
        )
    if contract is Contract.V032 and not _has_v032_contract():
        raise ElasticKVStartupError(
            f"vLLM {version} lacks the 0.32 KV-cache contract elastickv relies on "
            "(KVCacheTensor strides, KVCacheLayout, kv_cache_allocation_context); "
            f"supported: {supported}"
        )
    if contract is Contract.V028 and not _has_v028_contract():
        raise ElasticKVStartupError(
            f"vLLM {version} lacks the 0.28 KV-cache contract elastickv relies on (per-backend "
            "get_kv_cache_shape/get_kv_cache_stride_order, one KVCacheTensor per layer); "
            f"supported: {supported}"
        )
    return contract
