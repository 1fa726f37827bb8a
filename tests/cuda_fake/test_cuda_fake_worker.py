"""The vLLM plugin's GPU worker storage through the real cuda-bindings against the strict fake
driver: a worker places its KV cache on the CUDA backend (the shared zero page by default),
maps what the scheduler grants (page grants over the allocator and a credit policy, as the
scheduler's block pool drives them), holds a release until the step that may still read the
page is done, maps vLLM's warm-up blocks itself until the first planned step, and stops a step
it cannot map; no handle, mapping or reservation is left.

Fence: the fake has no events, so the worker's fence here counts queued kernels (a step's
work is done once the fake has none pending, i.e. after a synchronise), the question a CUDA
event answers on a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fakecuda_lib import CUDA_ERROR_OUT_OF_MEMORY, FakeCuda
from pages import assert_consistent

from elastickv.alloc import BlockAllocator
from elastickv.control import open_ledger
from elastickv.control.credit import CreditPolicy
from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.worker.worker_kv import PageMapError, WorkerKV
from elastickv.vmm.cuda import CudaBackend, CudaRange
from elastickv.vmm.grants import PageGrants

PAGE = 2 << 20
# 2 layers, NHD (FlashAttention's layout), 16 tokens × 8 heads × 64 × fp16: 32 KiB per block
# and layer, 64 blocks to a 2 MiB page: 4 MiB of pages per 64-block slab.
GEOMETRY = KVCacheGeometry(
    num_layers=2, num_blocks=512, num_kv_heads=8, block_size=16, head_size=64,
    dtype="float16", layout="NHD",
)  # fmt: skip


class QueuedKernels:
    """A worker fence on the fake: a step's work is done once no kernel is pending."""

    def __init__(self, fake: FakeCuda, backend: CudaBackend) -> None:
        self.fake = fake
        self.backend = backend
        self.marks = 0

    def mark(self) -> object:
        self.marks += 1
        return self.marks

    def done(self, token: object) -> bool:
        return self.fake.pending_kernels() == 0

    def wait(self) -> None:
        with self.backend.driver.current():
            self.backend.driver.synchronize(None)


@pytest.fixture
def backend() -> Iterator[CudaBackend]:
    made = CudaBackend(page_size=PAGE, handle_pool_size=4)  # the default: the zero page
    yield made
    with made.driver.current():
        made.driver.synchronize(None)


@pytest.fixture
def ledger_dir(tmp_path: Path) -> Path:
    with open_ledger(directory=str(tmp_path), total_bytes=64 * PAGE, utilization=1.0):
        pass
    return tmp_path


def worker_on(backend: CudaBackend, fence: QueuedKernels | None) -> tuple[WorkerKV, CudaRange]:
    vrange = backend.reserve(GEOMETRY.backing_bytes)
    kv = WorkerKV.over(GEOMETRY, vrange, GEOMETRY.backing_bytes, "cuda-fake", fence)
    return kv, vrange


def scheduler(ledger_dir: Path) -> tuple[BlockAllocator, PageGrants, CreditPolicy]:
    """The scheduler's side as its block pool builds it: grants (no memory), credit in the
    ledger, the allocator (its null block granted first)."""
    grants = PageGrants(
        GEOMETRY.backing_bytes // PAGE * PAGE, PAGE, held=GEOMETRY.block_pages(0, PAGE)
    )
    ledger = open_ledger(directory=str(ledger_dir), create=False)
    policy = CreditPolicy(ledger.register("gpu-engine"))
    allocator = BlockAllocator(GEOMETRY, grants, policy, max_hot_pages=0)
    return allocator, grants, policy


def test_the_worker_maps_what_was_granted_with_the_zero_page_elsewhere(
    fake: FakeCuda, backend: CudaBackend, ledger_dir: Path
) -> None:
    kv, vrange = worker_on(backend, QueuedKernels(fake, backend))
    assert vrange.uncommitted == "zero"
    allocator, grants, policy = scheduler(ledger_dir)
    try:
        assert vrange.committed_pages() == kv.null_pages  # the null block, at placement
        assert_consistent(fake, vrange)
        policy.settle(16 * PAGE)  # credit for the step
        blocks = allocator.allocate(130)  # the null slab's 63 and a second slab, and more
        assert blocks is not None
        kv.apply(grants.drain())
        kv.follower.step_queued()
        assert vrange.committed_pages() == allocator.committed_pages()
        assert_consistent(fake, vrange)  # granted pages real, every other one the zero page
        # A stray read of an uncommitted page (a kernel reading past its blocks) sees zeros.
        stray = vrange.base_address + max(vrange.committed_pages()) * PAGE + PAGE
        assert fake.launch(stray, PAGE) == 0
        kv.follower.wait()
        assert fake.sticky_error() == 0
        allocator.free(blocks)
        kv.apply(grants.drain())
        kv.settle()  # the engine idles
        assert vrange.committed_pages() == kv.null_pages
        assert_consistent(fake, vrange)
    finally:
        allocator.close()
        vrange.close()
        policy.handle.close()


def test_a_release_waits_for_the_step_that_may_still_read_the_page(
    fake: FakeCuda, backend: CudaBackend, ledger_dir: Path
) -> None:
    """vLLM's asynchronous scheduling queues a step before the previous one's output frees
    its blocks: the page released with the next step's batch may still be read by the queued
    step, so the worker keeps it mapped until that step's work is done, then releases it."""
    kv, vrange = worker_on(backend, QueuedKernels(fake, backend))
    allocator, grants, policy = scheduler(ledger_dir)
    try:
        policy.settle(8 * PAGE)
        blocks = allocator.allocate(100)
        assert blocks is not None
        kv.apply(grants.drain())  # step k: maps the second slab
        second = sorted(allocator.committed_pages() - kv.null_pages)
        address = vrange.base_address + second[0] * PAGE
        assert fake.launch(address, PAGE) == 0  # step k's kernel, queued, reads it
        kv.follower.step_queued()
        allocator.free(blocks)  # its request finished: the scheduler releases the page
        kv.apply(grants.drain())  # step k+1 arrives while step k's kernel is queued
        assert set(second) <= kv.follower.held_pages  # still mapped for the queued kernel
        assert set(second) <= vrange.committed_pages()
        assert fake.sticky_error() == 0
        kv.follower.wait()  # step k's work is done
        kv.apply(None)  # the next step: the release goes now
        assert not kv.follower.held_pages
        assert vrange.committed_pages() == kv.null_pages
        assert fake.sticky_error() == 0
        assert_consistent(fake, vrange)
    finally:
        allocator.close()
        vrange.close()
        policy.handle.close()


def test_the_warm_ups_blocks_are_mapped_by_the_worker_until_the_first_planned_step(
    fake: FakeCuda, backend: CudaBackend
) -> None:
    """Model Runner V2 warms its kernels up with requests holding blocks 1..K, which no
    scheduler granted: the worker maps their pages for it and releases them (after the
    warm-up's work is done) before the first step the scheduler planned."""
    kv, vrange = worker_on(backend, QueuedKernels(fake, backend))
    try:
        kv.map_unplanned(range(1, 200))
        warm = vrange.committed_pages()
        assert warm > kv.null_pages and kv.unplanned == warm - kv.null_pages
        assert fake.launch(vrange.base_address + max(warm) * PAGE, PAGE) == 0  # warm-up work
        kv.follower.step_queued()
        kv.apply(None)  # the first planned step: the warm-up's pages go back
        assert vrange.committed_pages() == kv.null_pages and not kv.unplanned
        assert fake.sticky_error() == 0
        assert_consistent(fake, vrange)
    finally:
        vrange.close()


def test_a_worker_that_cannot_map_what_was_granted_stops_the_step(
    fake: FakeCuda, backend: CudaBackend, ledger_dir: Path
) -> None:
    """Device memory taken outside the ledger: the driver refuses the physical pages. The
    worker raises PageMapError (the step never runs on an unmapped block) and leaves no trace
    of the batch."""
    kv, vrange = worker_on(backend, QueuedKernels(fake, backend))
    allocator, grants, policy = scheduler(ledger_dir)
    try:
        policy.settle(8 * PAGE)
        assert allocator.allocate(200) is not None
        fake.fail("cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY)
        with pytest.raises(PageMapError, match="cannot map the KV pages the scheduler granted"):
            kv.apply(grants.drain())
        fake.disarm("cuMemCreate")
        assert vrange.committed_pages() == kv.null_pages
        assert kv.follower.seq == 0  # the batch was not applied
        assert_consistent(fake, vrange)
    finally:
        allocator.close()
        vrange.close()
        policy.handle.close()


def test_the_ledger_of_a_gpu_is_named_by_its_uuid(fake: FakeCuda) -> None:
    """``--device cuda:0`` (the CLI's) and a worker's export name the same ledger: the one of
    the GPU's UUID, as the driver reports it."""
    from elastickv.cli.ledger_view import device_key
    from elastickv.control import cuda_device_key
    from elastickv.vmm.cuda_driver import CudaDriver

    key = device_key("cuda:0")
    assert key == cuda_device_key(CudaDriver(0).uuid())
    assert key.startswith("cuda-gpu-")
    assert device_key("host") == "host"
