"""The engine-config check without vLLM, on config objects shaped like vLLM's (the real
``create_engine_config`` hook is tested against vLLM 0.28 and 0.32 in
tests/integration_vllm: refused before any weight loads)."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest

from elastickv.integrations.vllm import preflight
from elastickv.integrations.vllm.errors import ElasticKVStartupError


class Backend(enum.Enum):
    CPU_ATTN = "cpu"
    FLASH_ATTN = "flash"


def config(
    *,
    device: str = "cpu",
    cache_dtype: str = "auto",
    tp: int = 1,
    pp: int = 1,
    backend: Backend | None = None,
) -> SimpleNamespace:
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        attention_config=SimpleNamespace(backend=backend),
    )


@pytest.mark.parametrize(
    "ok",
    [config(), config(cache_dtype="bfloat16"), config(backend=Backend.CPU_ATTN), config(tp=4)],
)
def test_supported_configs_pass(ok: SimpleNamespace) -> None:
    assert preflight.problems(ok) == []
    preflight.check(ok)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (config(cache_dtype="fp8"), "--kv-cache-dtype fp8 (a quantized KV cache); use"),
        (config(pp=2), "--pipeline-parallel-size 2: elastickv commits a block on every rank"),
        (config(backend=Backend.FLASH_ATTN), "--attention-backend FLASH_ATTN"),
        (config(device="cuda"), "the cuda platform"),
    ],
)
def test_each_unsupported_option_is_named(bad: SimpleNamespace, message: str) -> None:
    with pytest.raises(ElasticKVStartupError, match="unset ELASTICKV") as caught:
        preflight.check(bad)
    assert message in str(caught.value)


def test_all_problems_in_one_error() -> None:
    assert len(preflight.problems(config(cache_dtype="fp8", tp=4, pp=2))) == 2
