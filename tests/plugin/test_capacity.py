"""The KV capacity the plugin advertises to vLLM, without vLLM: bounded by what the engine can
use at once, and a block count that starts every layer of a layer-major layout on a page
boundary (pages otherwise straddle two block groups, and a limit holds fewer blocks)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.alloc import PageMap
from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.worker.capacity import advertised_capacity, page_aligned_blocks
from elastickv.vmm import host_granularity

KiB = 1 << 10


def fake_worker(layer_bytes: list[int], block_size: int, max_seqs: int, max_len: int) -> object:
    """The attributes ``advertised_capacity`` reads from a vLLM worker."""
    specs = {
        f"layer.{i}": SimpleNamespace(page_size_bytes=size, block_size=block_size)
        for i, size in enumerate(layer_bytes)
    }
    return SimpleNamespace(
        model_runner=SimpleNamespace(get_kv_cache_spec=lambda: specs),
        vllm_config=SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=max_seqs),
            model_config=SimpleNamespace(max_model_len=max_len),
        ),
    )


def test_tiny_model_on_small_pages_gets_page_aligned_layers() -> None:
    """The built-in tiny model (2 layers of 16 KiB per 32-token block) at 8 sequences of 256
    tokens needs 65 blocks; 68 start its second layer on a 64 KiB page, and then every
    group of pages holds whole blocks: 8 pages hold 16 blocks, as native vLLM's 512 KiB."""
    config = ElasticConfig(page_size=64 * KiB, virtual_capacity_bytes=64 << 20)
    advertised = advertised_capacity(fake_worker([16 * KiB] * 2, 32, 8, 256), config)
    assert advertised == 68 * 32 * KiB

    def slab_sizes(num_blocks: int) -> set[int]:
        geometry = KVCacheGeometry(
            num_layers=2, num_blocks=num_blocks, num_kv_heads=2, block_size=32, head_size=32,
            dtype="float32", layout="LBHNC",
        )  # fmt: skip
        return {len(blocks) for blocks in PageMap(geometry, 64 * KiB).slab_blocks}

    assert slab_sizes(68) == {4}  # 4 blocks on 2 pages, every one
    assert slab_sizes(65) != {4}  # before: groups of 3 and 1 blocks sharing pages


# No deadline: a loaded machine may stall an example past hypothesis's 200 ms.
@settings(deadline=None)
@given(
    layer_bytes=st.lists(
        st.sampled_from([512, 4 * KiB, 16 * KiB, 48 * KiB, 96 * KiB]), min_size=1, max_size=4
    ),
    pages=st.integers(1, 64),
    max_seqs=st.integers(1, 64),
    max_len=st.integers(1, 4096),
    virtual_blocks=st.integers(0, 5000),
)
def test_advertised_blocks_align_every_layer_and_stay_within_both_bounds(
    layer_bytes: list[int], pages: int, max_seqs: int, max_len: int, virtual_blocks: int
) -> None:
    page = pages * host_granularity()
    block_bytes = sum(layer_bytes)
    virtual = max(virtual_blocks * block_bytes + block_bytes // 2, page)  # at least a page
    virtual_blocks = virtual // block_bytes
    config = ElasticConfig(page_size=page, virtual_capacity_bytes=virtual)
    advertised = advertised_capacity(fake_worker(layer_bytes, 16, max_seqs, max_len), config)
    blocks, rest = divmod(advertised, block_bytes)
    align = page_aligned_blocks(layer_bytes, page)
    usable = max_seqs * -(-max_len // 16) + 1
    assert rest == 0 and advertised <= virtual
    if align > usable:  # aligning would more than double the blocks: not done
        assert blocks == min(virtual_blocks, usable)
    elif virtual_blocks >= align:
        assert blocks % align == 0
        assert all(blocks * size % page == 0 for size in layer_bytes)  # every layer aligned
        assert blocks >= min(usable, virtual_blocks - virtual_blocks % align)
        assert blocks < usable + align  # never more than one aligned group above the bound
    else:
        assert blocks == min(virtual_blocks, usable + -usable % align)
