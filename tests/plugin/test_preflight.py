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
    FLASHMLA = "flashmla"
    FLASHINFER = "flashinfer"
    ROCM_ATTN = "rocm"


def config(
    *,
    device: str = "cpu",
    cache_dtype: str = "auto",
    tp: int = 1,
    pp: int = 1,
    backend: Backend | None = None,
    sleep: bool = False,
    sleep_backend: str = "cumem",
    kv_bytes: int | None = None,
) -> SimpleNamespace:
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        model_config=SimpleNamespace(enable_sleep_mode=sleep, sleep_mode_backend=sleep_backend),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, kv_cache_memory_bytes=kv_bytes),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        attention_config=SimpleNamespace(backend=backend),
    )


@pytest.mark.parametrize(
    ("ok", "platform"),
    [
        (config(), "cpu"),
        (config(cache_dtype="bfloat16"), "cpu"),
        (config(backend=Backend.CPU_ATTN), "cpu"),
        (config(tp=4), "cpu"),
        (config(device="cuda"), "cuda"),
        (config(device="cuda", backend=Backend.FLASH_ATTN, tp=2), "cuda"),
        (config(device="cuda", backend=Backend.FLASHMLA), "cuda"),
        (config(device="cuda", cache_dtype="fp8"), "cuda"),
        (config(device="cuda", cache_dtype="fp8_e5m2"), "cuda"),
        # vLLM's sleep mode: its pool holds the weights, never the elastic KV cache.
        (config(device="cuda", sleep=True), "cuda"),
    ],
)
def test_supported_configs_pass(ok: SimpleNamespace, platform: str) -> None:
    assert preflight.problems(ok, platform) == []
    preflight.check(ok, platform)


@pytest.mark.parametrize(
    ("bad", "platform", "message"),
    [
        (config(cache_dtype="fp8"), "cpu", "--kv-cache-dtype fp8 (a quantized KV cache); use"),
        (config(pp=2), "cpu", "--pipeline-parallel-size 2: elastickv commits a block on every"),
        (config(backend=Backend.FLASH_ATTN), "cpu", "--attention-backend FLASH_ATTN"),
        (config(device="cuda", backend=Backend.CPU_ATTN), "cuda", "--attention-backend CPU"),
        # Not proven by the runner contract tests here (flashinfer does not import).
        (config(device="cuda", backend=Backend.FLASHINFER), "cuda", "--attention-backend FLASH"),
        (config(device="cuda", cache_dtype="nvfp4"), "cuda", "--kv-cache-dtype nvfp4 (a quan"),
        (config(device="rocm"), "rocm", "the rocm platform: elastickv places the KV cache on"),
        (config(device="xpu"), "xpu", "the xpu platform: elastickv places the KV cache on"),
        (config(sleep=True), "cpu", "--enable-sleep-mode on the cpu platform: vLLM's sleep mode"),
        (
            config(device="cuda", sleep=True, sleep_backend="criu"),
            "cuda",
            "sleep_mode_backend = 'criu': elastickv keeps its KV cache mapped",
        ),
    ],
)
def test_each_unsupported_option_is_named(
    bad: SimpleNamespace, platform: str, message: str
) -> None:
    with pytest.raises(ElasticKVStartupError, match="unset ELASTICKV") as caught:
        preflight.check(bad, platform)
    assert message in str(caught.value)


def test_all_problems_in_one_error() -> None:
    assert len(preflight.problems(config(cache_dtype="fp8", tp=4, pp=2))) == 2


def test_the_kv_cache_is_sized_elsewhere_unless_the_user_sized_it() -> None:
    """vLLM's CPU worker refuses to start unless ``--gpu-memory-utilization`` of the host is
    free, unless ``--kv-cache-memory-bytes`` is set: an elastic engine sets it (a second
    engine on a host could not start otherwise), and leaves the user's own value alone."""
    unset = config()
    preflight.size_elsewhere(unset, 8 << 30)
    assert unset.cache_config.kv_cache_memory_bytes == 8 << 30
    mine = config(kv_bytes=1 << 30)
    preflight.size_elsewhere(mine, 8 << 30)
    assert mine.cache_config.kv_cache_memory_bytes == 1 << 30
