"""The block allocator on the CUDA backend, through the real bindings and the strict fake, with
uncommitted pages on the shared zero page (the default) and unmapped.

64 KiB granularity keeps the geometry small while blocks still straddle and share pages.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from fakecuda_lib import FakeCuda
from pages import assert_consistent

from elastickv.alloc import BlockAllocator, FixedBudget
from elastickv.geometry import KVCacheGeometry, vllm028_layout
from elastickv.vmm.cuda import UNCOMMITTED_MODES, CudaBackend, CudaRange

PAGE = 64 * 1024
GEOMETRIES = {
    # 12 KiB per (layer, block): blocks straddle page boundaries in every layer.
    "per-layer": KVCacheGeometry(
        num_layers=3, num_blocks=60, num_kv_heads=3, block_size=16, head_size=64, layout="NHD"
    ),
    # Block outermost, 36 KiB per block: neighbours share their boundary page.
    "cross-layer": KVCacheGeometry(
        num_layers=3,
        num_blocks=60,
        num_kv_heads=3,
        block_size=16,
        head_size=64,
        layout=vllm028_layout("NHD", cross_layer=True),
        contract="0.28",
    ),
}


@pytest.fixture(params=UNCOMMITTED_MODES)
def backend(request: pytest.FixtureRequest, fake: FakeCuda) -> CudaBackend:
    fake.set_granularity(PAGE)
    return CudaBackend(page_size=PAGE, handle_pool_size=4, uncommitted=request.param)


@pytest.fixture(params=sorted(GEOMETRIES))
def setup(request: Any, backend: CudaBackend) -> Iterator[tuple[BlockAllocator, CudaRange]]:
    geometry = GEOMETRIES[request.param]
    with backend.reserve(geometry.backing_bytes) as vrange:
        alloc = BlockAllocator(geometry, vrange, FixedBudget(1 << 30), max_hot_pages=2)
        try:
            yield alloc, vrange
        finally:
            alloc.close()


def check_agreement(fake: FakeCuda, alloc: BlockAllocator, vrange: CudaRange) -> None:
    assert vrange.committed_pages() == alloc.committed_pages()
    assert_consistent(fake, vrange)


def test_random_allocate_and_free(fake: FakeCuda, setup: tuple[BlockAllocator, CudaRange]) -> None:
    alloc, vrange = setup
    rng = random.Random(13)
    live: list[int] = []
    for _ in range(60):
        if live and rng.random() < 0.45:
            rng.shuffle(live)
            count = rng.randint(1, len(live))
            alloc.free(live[:count])
            del live[:count]
        else:
            got = alloc.allocate(rng.randint(1, 6))
            if got is not None:
                live.extend(got)
        check_agreement(fake, alloc, vrange)
    alloc.free(live)
    alloc.trim()
    check_agreement(fake, alloc, vrange)


def test_driver_failure_midway_is_a_clean_refusal(
    fake: FakeCuda, setup: tuple[BlockAllocator, CudaRange]
) -> None:
    alloc, vrange = setup
    first = alloc.allocate(3)
    assert first is not None
    before = alloc.committed_pages()
    fake.fail("cuMemMap", nth=2)
    assert alloc.allocate(20) is None
    assert alloc.committed_pages() == before
    check_agreement(fake, alloc, vrange)
    assert alloc.allocate(20) is not None
    check_agreement(fake, alloc, vrange)


def test_interrupt_midway_propagates_and_leaves_no_trace(
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeCuda,
    backend: CudaBackend,
    setup: tuple[BlockAllocator, CudaRange],
) -> None:
    alloc, vrange = setup
    assert alloc.allocate(2) is not None
    before = alloc.committed_pages()
    real = backend.driver.map
    calls = 0

    def interrupted(address: int, size: int, handle: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        real(address, size, handle)

    monkeypatch.setattr(backend.driver, "map", interrupted)
    with pytest.raises(KeyboardInterrupt):
        alloc.allocate(20)
    monkeypatch.undo()
    assert alloc.committed_pages() == before
    check_agreement(fake, alloc, vrange)
    assert alloc.allocate(20) is not None
    check_agreement(fake, alloc, vrange)
