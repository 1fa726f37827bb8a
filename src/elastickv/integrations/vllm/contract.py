"""Which vLLM KV-cache contract the installed vLLM offers: capability first, version as a guard.

Anything we have not verified fails start-up with the version and the supported list; a
silent fallback to native allocation would hide that the engine is not elastic.
"""

from __future__ import annotations

import inspect

from elastickv.geometry import Contract
from elastickv.integrations.vllm.errors import ElasticKVStartupError

# vLLM release series -> the contract this build of the plugin implements for it.
SUPPORTED_SERIES: dict[str, Contract] = {"0.32": Contract.V032}


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


def detect_contract(version: str | None = None) -> Contract:
    """The contract to apply, or :class:`ElasticKVStartupError` naming what is supported."""
    version = installed_version() if version is None else version
    supported = ", ".join(f"{s}.x ({c.value} contract)" for s, c in SUPPORTED_SERIES.items())
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
    return contract
