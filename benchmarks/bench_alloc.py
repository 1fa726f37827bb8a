"""Allocator hot path and capacity query vs vLLM's own ``BlockPool`` in one run; plus cold path.

Hot path: pages already committed (the hot reserve is large enough to keep them), so
``allocate`` + ``free`` is pure bookkeeping — the same work as vLLM 0.32's
``BlockPool.get_new_blocks`` + ``free_blocks`` (prefix caching off, the cheaper baseline).
Both sides are timed in adjacent rounds, alternating which goes first; ``ratio`` is the
median per-round throughput ratio (ours / vLLM, so > 1 means faster than vLLM), which
cancels drift from other load; ``ratio_q1``/``ratio_q3`` are its quartiles over the rounds
and ``ratio_best`` compares each side's fastest round.

Workloads: one request of 1/4/16/64 blocks allocated and freed; the mixed batch (16
requests of mixed sizes, freed in another order); and a scheduler step as vLLM 0.32 issues
it: 16 requests admitted with their prompts, two decode steps in which each takes one more
block, then the requests finish in another order and each frees its blocks in reverse
(``free_blocks(reversed(blocks))``, one call per request). The elastic block pool hands a
step's frees to the allocator in one call (``update_from_output`` is a free batch), so that
workload runs both ways on our side; vLLM's side is always one call per request.

Block pool: the same scheduler step through the scheduler-side block pools, driven the way
``KVCacheManager.allocate_slots`` drives them (the elastic pool's per-step hooks included:
the limit check, the credit, the admission headroom, the step's page operations, the free
batch): ``ElasticBlockPool`` against
vLLM's ``BlockPool``. Our pool does vLLM's bookkeeping plus the allocator's, so this ratio is
the cost of elasticity per step, not a race.

Cold path: every allocation commits fresh pages on the real host backend and every free
releases them; no vLLM counterpart (its pool is fixed).

    python benchmarks/bench_alloc.py [--json]
    PYTHONPATH=src .venvs/vllm-0.32/bin/python benchmarks/bench_alloc.py --json   # with vLLM
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

from elastickv.alloc import BlockAllocator, Unlimited
from elastickv.geometry import KVCacheGeometry
from elastickv.vmm import HostBackend, HostRange

CAPACITY_TARGET_US = 2.0
THROUGHPUT_TARGET = 1.0
MIXED_SIZES = (1, 2, 4, 8, 16, 3, 5, 12, 1, 1, 2, 6, 9, 1, 4, 16)
# The order the mixed batch's requests finish in, and how many decode steps each runs.
FINISH_ORDER = (3, 0, 7, 12, 1, 15, 5, 9, 2, 14, 6, 11, 4, 13, 8, 10)
DECODE_STEPS = 2


@dataclass(frozen=True)
class HotResult:
    """One hot-path workload: µs per alloc+free pair on each side, throughput ratio."""

    workload: str
    blocks_per_request: float
    ours_us_per_pair: float
    vllm_us_per_pair: float | None
    ratio: float | None
    ratio_q1: float | None
    ratio_q3: float | None
    ratio_best: float | None
    meets_target: bool | None


@dataclass(frozen=True)
class PoolResult:
    """The scheduler step through the block pools: µs per step on each side."""

    workload: str
    elastic_us_per_step: float
    vllm_us_per_step: float
    ratio: float
    ratio_q1: float
    ratio_q3: float
    ratio_best: float


@dataclass(frozen=True)
class QueryResult:
    query: str
    us_per_call: float
    vllm_us_per_call: float | None
    meets_target: bool


@dataclass(frozen=True)
class ColdResult:
    blocks_per_request: int
    pages_per_request: int
    us_per_pair: float
    us_per_page: float


Workload = Callable[[], None]


def llama_like(num_blocks: int, layers: int) -> KVCacheGeometry:
    """Llama-3-8B-shaped KV cache: 8 KV heads x 128, 16-token blocks, fp16, per-layer NHD."""
    return KVCacheGeometry(
        num_layers=layers,
        num_blocks=num_blocks,
        num_kv_heads=8,
        block_size=16,
        head_size=128,
        layout="NHD",
    )


def load_block_pool() -> Any:
    try:
        from vllm.v1.core.block_pool import BlockPool
    except Exception:
        return None
    return BlockPool


def time_per_call(fn: Workload, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


@dataclass(frozen=True)
class Paired:
    """Seconds per call on each side (median over rounds) and the per-round ratio theirs/ours
    (median and quartiles); ``best``: the ratio of each side's fastest round."""

    mine: float
    other: float | None
    ratio: float | None = None
    q1: float | None = None
    q3: float | None = None
    best: float | None = None


def paired(ours: Workload, theirs: Workload | None, iterations: int, rounds: int) -> Paired:
    mine: list[float] = []
    other: list[float] = []
    ratios: list[float] = []
    # Warm-up: a short untimed round on each side (same calls, same sizes).
    warmup = max(1, iterations // 10)
    time_per_call(ours, warmup)
    if theirs is not None:
        time_per_call(theirs, warmup)
    for index in range(rounds):
        # Alternate which side runs first so neither always gets the warmer caches.
        if theirs is not None and index % 2:
            b = time_per_call(theirs, iterations)
            a = time_per_call(ours, iterations)
        else:
            a = time_per_call(ours, iterations)
            b = time_per_call(theirs, iterations) if theirs is not None else 0.0
        mine.append(a)
        if theirs is not None:
            other.append(b)
            ratios.append(b / a)
    if theirs is None:
        return Paired(statistics.median(mine), None)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return Paired(
        mine=statistics.median(mine),
        other=statistics.median(other),
        ratio=statistics.median(ratios),
        q1=q1,
        q3=q3,
        best=min(other) / min(mine),
    )


def single(allocate: Callable[[int], Any], free: Callable[[Any], None], n: int) -> Workload:
    def run() -> None:
        free(allocate(n))

    return run


def mixed(allocate: Callable[[int], Any], free: Callable[[Any], None]) -> Workload:
    """A step of a batch: 16 requests of mixed sizes allocated, then freed in another order."""

    def run() -> None:
        held = [allocate(n) for n in MIXED_SIZES]
        for blocks in held[::2]:
            free(blocks)
        for blocks in held[1::2]:
            free(blocks)

    return run


def scheduler_step(
    allocate: Callable[[int], Any],
    free: Callable[[Any], None],
    reverse: Callable[[list[Any]], Any],
    *,
    batched: bool = False,
) -> Workload:
    """The mixed batch as vLLM's scheduler drives it: prompts, then ``DECODE_STEPS`` steps in
    which every request takes one more block, then the requests finish in ``FINISH_ORDER``
    and each frees its blocks in reverse (``batched``: all of them in one call)."""

    def run() -> None:
        held = [list(allocate(n)) for n in MIXED_SIZES]
        for _ in range(DECODE_STEPS):
            for blocks in held:
                blocks.extend(allocate(1))
        if batched:
            free([b for i in FINISH_ORDER for b in reverse(held[i])])
        else:
            for i in FINISH_ORDER:
                free(reverse(held[i]))

    return run


def reversed_list(blocks: list[Any]) -> list[int]:
    return blocks[::-1]


def hot_path(allocator: BlockAllocator, pool: Any, iterations: int, rounds: int) -> list[HotResult]:
    results = []
    workloads: list[tuple[str, float, int, Workload, Workload | None]] = []
    for n in (1, 4, 16, 64):
        ours = single(allocator.allocate, allocator.free, n)
        theirs = None if pool is None else single(pool.get_new_blocks, pool.free_blocks, n)
        workloads.append((f"alloc+free {n}", float(n), 1, ours, theirs))
    ours = mixed(allocator.allocate, allocator.free)
    theirs = None if pool is None else mixed(pool.get_new_blocks, pool.free_blocks)
    workloads.append(
        ("mixed batch of 16 requests", statistics.mean(MIXED_SIZES), len(MIXED_SIZES), ours, theirs)
    )
    grown = statistics.mean(MIXED_SIZES) + DECODE_STEPS
    theirs = (
        None
        if pool is None
        else scheduler_step(pool.get_new_blocks, pool.free_blocks, reversed)  # vLLM's own
    )
    for name, batched in (("frees one by one", False), ("frees batched", True)):
        ours = scheduler_step(allocator.allocate, allocator.free, reversed_list, batched=batched)
        workloads.append((f"scheduler step, {name}", grown, len(MIXED_SIZES), ours, theirs))
    for name, size, scale, ours, theirs in workloads:
        committed = allocator.stats().pages_committed
        timed = paired(ours, theirs, max(1, iterations // scale), rounds)
        if allocator.stats().pages_committed != committed:
            raise RuntimeError(f"{name}: the hot path committed pages; raise max_hot_pages")
        results.append(
            HotResult(
                workload=name,
                blocks_per_request=size,
                ours_us_per_pair=round(timed.mine / scale * 1e6, 3),
                vllm_us_per_pair=None
                if timed.other is None
                else round(timed.other / scale * 1e6, 3),
                ratio=_round(timed.ratio),
                ratio_q1=_round(timed.q1),
                ratio_q3=_round(timed.q3),
                ratio_best=_round(timed.best),
                meets_target=None if timed.ratio is None else timed.ratio >= THROUGHPUT_TARGET,
            )
        )
    return results


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def pool_step(
    geometry: KVCacheGeometry, page_size: int, iterations: int, rounds: int
) -> PoolResult | None:
    """The scheduler step through ``ElasticBlockPool`` and vLLM's ``BlockPool`` (needs vLLM)."""
    try:
        from vllm.v1.core.block_pool import BlockPool

        from elastickv.integrations.vllm.config import ElasticConfig
        from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool
        from elastickv.integrations.vllm.scheduler.store import REGISTRY, ElasticStore, local_policy
    except Exception:
        return None
    config = ElasticConfig(page_size=page_size, hot_max_pages=1 << 20)
    store = ElasticStore.for_workers(
        config, geometry, geometry.backing_bytes, 1, "host", local_policy
    )
    REGISTRY.publish(store)
    elastic = ElasticBlockPool(geometry.num_blocks, False, 16)
    native = BlockPool(geometry.num_blocks, False, 16)
    try:
        warm = elastic.allocator.allocate(sum(MIXED_SIZES) * 2 + 64)
        assert warm is not None
        elastic.allocator.free(warm)  # pages stay committed: the step never commits

        def drive(pool: Any, hooks: bool) -> Workload:
            # What allocate_slots and the scheduler around it call on the pool; with the
            # hooks, also what the per-step hook does around ``schedule``.
            requests = [
                SimpleNamespace(request_id=str(i), num_tokens=16 * n, num_computed_tokens=0)
                for i, n in enumerate(MIXED_SIZES)
            ]
            scheduler = SimpleNamespace(
                running=[],
                waiting=[],
                requests={},
                max_num_scheduled_tokens=2048,
                max_num_running_reqs=len(requests),
                kv_cache_manager=SimpleNamespace(watermark_blocks=0),
            )
            output = SimpleNamespace()
            holders: dict[str, list[Any]] = {}

            def allocate(n: int) -> list[Any]:
                if pool.get_num_free_blocks() < n:
                    raise RuntimeError("the pool is too small for the step")
                got: list[Any] = pool.get_new_blocks(n)
                return got

            def step(body: Callable[[], None]) -> None:
                if hooks:
                    pool.begin_step(scheduler)
                body()
                if hooks:
                    pool.end_step(scheduler, output)

            def admit() -> None:
                for request, n in zip(requests, MIXED_SIZES, strict=True):
                    holders[request.request_id] = allocate(n)

            def decode() -> None:
                for request in requests:
                    holders[request.request_id].extend(allocate(1))

            def run() -> None:
                scheduler.running = []
                step(admit)
                scheduler.running = requests
                for _ in range(DECODE_STEPS):
                    step(decode)
                # With the hooks, batched since the last step: the next step hands them over.
                for i in FINISH_ORDER:
                    pool.free_blocks(reversed(holders.pop(requests[i].request_id)))

            return run

        timed = paired(drive(elastic, True), drive(native, False), iterations, rounds)
    finally:
        elastic.close_elastic()
    assert timed.other is not None and timed.ratio is not None
    assert timed.q1 is not None and timed.q3 is not None and timed.best is not None
    return PoolResult(
        workload="scheduler step (16 requests)",
        elastic_us_per_step=round(timed.mine * 1e6, 2),
        vllm_us_per_step=round(timed.other * 1e6, 2),
        ratio=round(timed.ratio, 3),
        ratio_q1=round(timed.q1, 3),
        ratio_q3=round(timed.q3, 3),
        ratio_best=round(timed.best, 3),
    )


def capacity_queries(allocator: BlockAllocator, pool: Any, iterations: int) -> list[QueryResult]:
    def ours_free() -> None:
        _ = allocator.num_free_blocks

    def ours_can() -> None:
        allocator.can_allocate(16)

    def theirs_free() -> None:
        pool.get_num_free_blocks()

    results = []
    baseline = None if pool is None else time_per_call(theirs_free, iterations) * 1e6
    for name, fn in (("num_free_blocks", ours_free), ("can_allocate(16)", ours_can)):
        us = statistics.median(time_per_call(fn, iterations) for _ in range(5)) * 1e6
        results.append(
            QueryResult(
                query=name,
                us_per_call=round(us, 3),
                vllm_us_per_call=None if baseline is None else round(baseline, 3),
                meets_target=us <= CAPACITY_TARGET_US,
            )
        )
    return results


def cold_path(vrange: HostRange, geometry: KVCacheGeometry, iterations: int) -> list[ColdResult]:
    results = []
    allocator = BlockAllocator(geometry, vrange, Unlimited(), min_hot_pages=0, max_hot_pages=0)
    try:
        per_slab = allocator.page_map.typical_slab_blocks
        # Fill the null block's slab so every request needs fresh pages.
        assert allocator.allocate(per_slab - 1) is not None
        for n in (1, per_slab):
            start = time.perf_counter()
            pages = 0
            for _ in range(iterations):
                before = allocator.stats().pages_committed
                blocks = allocator.allocate(n)
                assert blocks is not None
                pages += allocator.stats().pages_committed - before
                allocator.free(blocks)
            elapsed = time.perf_counter() - start
            per_request = pages // iterations
            results.append(
                ColdResult(
                    blocks_per_request=n,
                    pages_per_request=per_request,
                    us_per_pair=round(elapsed / iterations * 1e6, 1),
                    us_per_page=round(elapsed / max(pages, 1) * 1e6, 1),
                )
            )
    finally:
        allocator.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--cold-iterations", type=int, default=20)
    args = parser.parse_args()

    geometry = llama_like(args.blocks, args.layers)
    block_pool_cls = load_block_pool()
    pool = None if block_pool_cls is None else block_pool_cls(args.blocks, False, 16)
    backend = HostBackend()
    gc.disable()
    try:
        with backend.reserve(geometry.backing_bytes) as vrange:
            allocator = BlockAllocator(geometry, vrange, Unlimited(), max_hot_pages=1 << 20)
            warm = allocator.allocate(sum(MIXED_SIZES) + 64)
            assert warm is not None
            allocator.free(warm)  # pages stay committed: the hot path never commits
            hot = hot_path(allocator, pool, args.iterations, args.rounds)
            queries = capacity_queries(allocator, pool, args.iterations * 25)
            hot_footprint = vrange.footprint_bytes()
            allocator.close()
        pool_result = None
        if pool is not None:
            pool_result = pool_step(
                geometry, backend.page_size, max(1, args.iterations // 16), args.rounds
            )
        with backend.reserve(geometry.backing_bytes) as vrange:
            cold = cold_path(vrange, geometry, args.cold_iterations)
    finally:
        gc.enable()

    report = {
        "geometry": {
            "layers": args.layers,
            "blocks": args.blocks,
            "page_size": backend.page_size,
            "blocks_per_slab": allocator.page_map.typical_slab_blocks,
            "pages_per_slab": allocator.page_map.typical_slab_pages,
        },
        "vllm_baseline": "vllm.v1.core.block_pool.BlockPool" if pool is not None else None,
        "baseline_note": None
        if pool is not None
        else "vLLM is not importable here: baseline unavailable, our side only",
        "hot_path_footprint_bytes": hot_footprint,
        "hot": [asdict(r) for r in hot],
        "block_pool": None if pool_result is None else asdict(pool_result),
        "capacity_query": [asdict(r) for r in queries],
        "cold": [asdict(r) for r in cold],
        "targets": {
            "hot_throughput_ratio_min": THROUGHPUT_TARGET,
            "capacity_query_us_max": CAPACITY_TARGET_US,
        },
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_tables(report)
    return 0


def print_tables(report: dict[str, Any]) -> None:
    from rich.table import Table

    from elastickv.cli.tables import output_console, print_table

    console = output_console()
    if report["baseline_note"]:
        console.print(f"[yellow]{report['baseline_note']}[/]")
    hot = Table(title="hot path (pages committed): alloc+free, µs per request")
    for column in ("workload", "ours", "vLLM BlockPool", "ratio (thr.)", "IQR", "best", "≥ 1.0"):
        hot.add_column(column)
    for r in report["hot"]:
        hot.add_row(
            r["workload"],
            f"{r['ours_us_per_pair']:.2f}",
            "-" if r["vllm_us_per_pair"] is None else f"{r['vllm_us_per_pair']:.2f}",
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
            "-" if r["ratio_q1"] is None else f"{r['ratio_q1']:.2f}–{r['ratio_q3']:.2f}",
            "-" if r["ratio_best"] is None else f"{r['ratio_best']:.2f}",
            "-" if r["meets_target"] is None else ("yes" if r["meets_target"] else "no"),
        )
    print_table(console, hot)
    if report["block_pool"] is not None:
        r = report["block_pool"]
        pools = Table(title="block pools, allocate_slots protocol: µs per scheduler step")
        for column in ("workload", "ElasticBlockPool", "vLLM BlockPool", "ratio", "IQR", "best"):
            pools.add_column(column)
        pools.add_row(
            r["workload"],
            f"{r['elastic_us_per_step']:.1f}",
            f"{r['vllm_us_per_step']:.1f}",
            f"{r['ratio']:.2f}",
            f"{r['ratio_q1']:.2f}–{r['ratio_q3']:.2f}",
            f"{r['ratio_best']:.2f}",
        )
        print_table(console, pools)
    query = Table(title="capacity query, µs per call")
    for column in ("query", "ours", "vLLM get_num_free_blocks", "≤ 2 µs"):
        query.add_column(column)
    for r in report["capacity_query"]:
        query.add_row(
            r["query"],
            f"{r['us_per_call']:.3f}",
            "-" if r["vllm_us_per_call"] is None else f"{r['vllm_us_per_call']:.3f}",
            "yes" if r["meets_target"] else "no",
        )
    print_table(console, query)
    cold = Table(title="cold path (commit + release included)")
    for column in ("blocks/request", "pages/request", "µs per pair", "µs per page"):
        cold.add_column(column)
    for r in report["cold"]:
        cold.add_row(
            str(r["blocks_per_request"]),
            str(r["pages_per_request"]),
            f"{r['us_per_pair']:.1f}",
            f"{r['us_per_page']:.1f}",
        )
    print_table(console, cold)


if __name__ == "__main__":
    raise SystemExit(main())
