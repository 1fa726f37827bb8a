"""What elastickv's sleep on a GPU relies on in vLLM's own sleep mode (0.32 and 0.28), read
from vLLM's sources and run against its real sleep-mode backend over a recording allocator:
the weights are allocated in the ``weights`` pool, a level-1 sleep copies that pool to host
memory and a level-2 sleep discards it, a weights-only wake maps it again (in 0.32 with the
runtime state, which is never deferred), and nothing puts the KV cache in any pool but the
``kv_cache`` one, which the plugin keeps out of use (tests/vllm/test_cuda_standin.py)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


class Allocator:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def sleep(self, offload_tags: tuple[str, ...]) -> None:
        self.calls.append(("sleep", tuple(offload_tags)))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> Allocator:
    import vllm.device_allocator

    recording = Allocator()
    monkeypatch.setattr(vllm.device_allocator, "get_mem_allocator_instance", lambda: recording)
    return recording


@pytest.mark.parametrize("level", [1, 2])
def test_a_level_keeps_or_drops_the_weights_and_a_weights_wake_maps_them(
    allocator: Allocator, level: int
) -> None:
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    backend = CuMemBackend.__new__(CuMemBackend)  # "cumem": the one the preflight accepts
    backend.suspend(level)
    assert str(backend.state()).endswith("SUSPENDED")
    backend.resume(["weights"])
    assert str(backend.state()).endswith("RUNNING")
    (sleep, offloaded), wake = allocator.calls
    assert sleep == "sleep" and ("weights" in offloaded) == (level == 1)
    assert wake == ("wake_up", ["weights"])


def test_the_weights_load_in_their_pool_and_the_kv_cache_in_its_own() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    load = inspect.getsource(Worker.load_model)
    assert '_maybe_get_memory_pool_context(tag="weights")' in load
    init = inspect.getsource(Worker.initialize_from_config)
    assert '_maybe_get_memory_pool_context(tag="kv_cache")' in init
    assert list(inspect.signature(Worker._maybe_get_memory_pool_context).parameters) == [
        "self",
        "tag",
    ]
    assert list(inspect.signature(Worker.sleep).parameters) == ["self", "level"]
    assert list(inspect.signature(Worker.wake_up).parameters) == ["self", "tags"]


def test_a_weights_wake_restores_every_pool_but_the_deferred_ones() -> None:
    """0.32 defers only weights and kv_cache: a weights-only wake also maps the runtime
    state back. 0.28 has no other pools (with kv_cache's out of use, only weights)."""
    import vllm.device_allocator as allocators

    deferrable = getattr(allocators, "DEFERRABLE_TAGS", None)
    assert deferrable in (None, ("weights", "kv_cache"))
    if deferrable is None:
        from vllm.v1.worker.gpu_worker import Worker

        source = inspect.getsource(Worker)
        assert 'tag="runtime"' not in source and 'tag="workspace"' not in source
