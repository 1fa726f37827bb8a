"""The per-step scheduler hook takes its fast form on this vLLM: compiled with the hooked
method's own parameters (no ``*args, **kwargs`` packing on every step); and no hook sits on
vLLM's per-request paths (the pool answers from the room it holds) nor on the processing of
a step's output (the blocks it frees are handed over by the next step)."""

from __future__ import annotations

from elastickv.integrations.vllm.hooks import compile_hook


def test_hooked_methods_get_compiled_hooks() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from elastickv.integrations.vllm.scheduler import scheduler_hooks
    from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool

    names = {"ElasticBlockPool": ElasticBlockPool, "elastic_pool": scheduler_hooks._elastic_pool}
    original = getattr(Scheduler.schedule, "__elastickv_original__", Scheduler.schedule)
    assert compile_hook(original, scheduler_hooks.SCHEDULE_HOOK, names, ("self",)) is not None


def test_no_hook_on_the_per_request_paths() -> None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    from elastickv.integrations.vllm.scheduler import scheduler_hooks

    scheduler_hooks.install()
    for method in (
        KVCacheCoordinator.get_num_blocks_to_allocate,
        KVCacheManager.allocate_slots,
        Scheduler.update_from_output,
    ):
        assert not hasattr(method, "__elastickv_original__"), method
