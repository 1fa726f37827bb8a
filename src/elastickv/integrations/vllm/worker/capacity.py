"""The KV capacity the plugin advertises to vLLM: bounded by what the engine can use at once,
and a block count that starts every layer of a layer-major layout on a page boundary. Free of
torch and vLLM, so that tools (the benchmarks' budget floors) can apply the same rule."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from elastickv.integrations.vllm.config import ElasticConfig


def advertised_capacity(worker: Any, config: ElasticConfig) -> int:
    """The KV bytes to tell vLLM it has: the virtual capacity, but never more than the engine
    can use at once (``max_num_seqs`` requests of ``max_model_len`` tokens, plus the null
    block). vLLM builds one Python object per block at start-up, so blocks beyond that bound
    would only cost start-up time and memory (1 TiB of a tiny model: 32M blocks, 120 s).

    The block count is a multiple of :func:`page_aligned_blocks` (rounded up from the bound,
    down from the virtual capacity; not where that multiple exceeds the bound), so in a
    layer-major layout every layer starts on a page boundary. Otherwise pages straddle the
    blocks of two layers at different block indices: with a tiny model on 64 KiB pages,
    8 pages held 12 blocks where 15 fit."""
    virtual = config.resolved_virtual_capacity()
    try:
        specs = list(worker.model_runner.get_kv_cache_spec().values())
        vllm_config = worker.vllm_config
        max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        max_len = int(vllm_config.model_config.max_model_len)
        layer_bytes = [int(spec.page_size_bytes) for spec in specs]
        block_size = int(specs[0].block_size)
    except (AttributeError, IndexError, TypeError, ValueError):
        return virtual  # an unfamiliar runner: keep the configured capacity
    if block_size <= 0 or min(layer_bytes) <= 0:
        return virtual
    block_bytes = sum(layer_bytes)
    align = page_aligned_blocks(layer_bytes, config.page_size)
    usable = max_seqs * -(-max_len // block_size) + 1
    if align > usable:
        align = 1  # rounding up would more than double the blocks (a tiny model on big pages)
    usable += -usable % align
    fits = virtual // block_bytes
    if fits >= align:
        fits -= fits % align
    return min(fits, usable) * block_bytes


def page_aligned_blocks(layer_block_bytes: Iterable[int], page_size: int) -> int:
    """The fewest blocks whose bytes in every layer fill whole pages: a block count that is a
    multiple of it starts every layer of a layer-major layout on a page boundary."""
    align = 1
    for size in set(layer_block_bytes):
        align = math.lcm(align, page_size // math.gcd(page_size, size))
    return align
