"""Host backend in one process: reservation, exact footprint, data, teardown, errors."""

from __future__ import annotations

import errno
import gc
import os
import threading
from collections.abc import Iterator

import pytest

from elastickv.vmm import (
    CommitError,
    HostBackend,
    HostPool,
    HostRange,
    OutOfPhysicalMemory,
    PageIndexError,
    PageSizeError,
    RangeClosedError,
    ReleaseError,
    ReservationError,
)
from elastickv.vmm.host import LibC

GiB = 1 << 30


@pytest.fixture
def backend() -> HostBackend:
    return HostBackend()


@pytest.fixture
def vrange(backend: HostBackend) -> Iterator[HostRange]:
    with backend.reserve(16 * backend.page_size) as reserved:
        yield reserved


def mapped_span(address: int) -> tuple[int, int, str] | None:
    """The /proc/self/maps entry containing ``address``: (start, end, permissions)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            bounds, perms = line.split()[:2]
            start, end = (int(x, 16) for x in bounds.split("-"))
            if start <= address < end:
                return start, end, perms
    return None


def proc_kib(path: str, key: str) -> int:
    with open(path) as stats:
        for line in stats:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{key} missing from {path}")


def test_reserve_64_gib_costs_nothing(backend: HostBackend) -> None:
    with backend.reserve(64 * GiB) as vrange:
        assert vrange.num_pages == 64 * GiB // backend.page_size
        assert vrange.size_bytes == 64 * GiB
        assert vrange.base_address % backend.page_size == 0
        assert vrange.footprint_bytes() == 0
        assert vrange.committed_pages() == frozenset()
        span = mapped_span(vrange.base_address)
        assert span is not None
        assert span[2].startswith("---")
        assert span[1] - vrange.base_address >= 64 * GiB
        last = vrange.num_pages - 1
        assert vrange.commit([0, last]) == 2
        assert vrange.footprint_bytes() == 2 * backend.page_size
        tensor = vrange.as_tensor()
        assert tensor.numel() == 64 * GiB
        tensor[-1] = 9
        assert int(tensor[-1]) == 9


def test_host_backend_is_available_here() -> None:
    assert HostBackend.is_available()


def test_impossible_reservation_fails_cleanly(backend: HostBackend) -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ReservationError, match="address space") as info:
        backend.reserve(1 << 60)
    assert info.value.errno == errno.ENOMEM
    assert len(os.listdir("/proc/self/fd")) == fds_before, "the pool fd is not leaked"


def test_reserve_rounds_up_to_pages(backend: HostBackend) -> None:
    with backend.reserve(1) as one:
        assert one.num_pages == 1
        assert one.size_bytes == backend.page_size
    with backend.reserve(backend.page_size + 1) as two:
        assert two.num_pages == 2


@pytest.mark.parametrize("size", [0, -1, True])
def test_reserve_rejects_bad_sizes(backend: HostBackend, size: int) -> None:
    with pytest.raises(ValueError, match="positive int"):
        backend.reserve(size)


def test_commit_and_release_change_footprint_exactly(vrange: HostRange) -> None:
    page = vrange.page_size
    assert vrange.commit([0, 3, 4, 5, 9]) == 5
    assert vrange.footprint_bytes() == 5 * page
    assert vrange.committed_pages() == {0, 3, 4, 5, 9}
    assert vrange.num_committed == 5
    assert vrange.committed_bytes() == 5 * page
    assert vrange.is_committed(4)
    assert not vrange.is_committed(6)

    assert vrange.commit([3, 4]) == 0, "committing committed pages is a no-op"
    assert vrange.commit([4, 5, 6]) == 1
    assert vrange.footprint_bytes() == 6 * page

    assert vrange.release([4]) == 1
    assert vrange.release([4]) == 0, "releasing an uncommitted page is a no-op"
    assert vrange.release([10, 11]) == 0
    assert vrange.footprint_bytes() == 5 * page
    assert vrange.release(range(16)) == 5
    assert vrange.footprint_bytes() == 0


def test_contiguous_runs_take_one_call_each(
    vrange: HostRange, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = vrange.pool
    allocations: list[tuple[int, int]] = []
    punches: list[tuple[int, int]] = []
    real_allocate, real_punch = pool.allocate, pool.punch

    def allocate(first: int, count: int) -> None:
        allocations.append((first, count))
        real_allocate(first, count)

    def punch(first: int, count: int) -> None:
        punches.append((first, count))
        real_punch(first, count)

    monkeypatch.setattr(pool, "allocate", allocate)
    monkeypatch.setattr(pool, "punch", punch)
    vrange.commit([9, 0, 4, 3, 5, 4, 10])
    assert allocations == [(0, 1), (3, 3), (9, 2)]
    vrange.commit([1, 2, 3])
    assert allocations[3:] == [(1, 2)]
    vrange.release(range(0, 16))
    assert punches == [(0, 6), (9, 2)]


def test_written_data_reads_back_and_recommit_reads_zeros(vrange: HostRange) -> None:
    page = vrange.page_size
    tensor = vrange.as_tensor()
    vrange.commit(range(4))
    for i in range(4):
        tensor[i * page : (i + 1) * page].fill_(i + 1)
    for i in range(4):
        chunk = tensor[i * page : (i + 1) * page]
        assert int(chunk.min()) == int(chunk.max()) == i + 1
    vrange.release([2])
    vrange.commit([2])
    chunk = tensor[2 * page : 3 * page]
    assert int(chunk.max()) == 0, "a recommitted page starts as zeros"
    assert int(tensor[3 * page]) == 4


def test_second_as_tensor_sees_the_same_memory(vrange: HostRange) -> None:
    vrange.commit([0])
    first, second = vrange.as_tensor(), vrange.as_tensor()
    first[123] = 77
    assert int(second[123]) == 77
    assert first.data_ptr() == second.data_ptr() == vrange.base_address


def test_released_memory_leaves_the_process(backend: HostBackend) -> None:
    pages = 32
    page = backend.page_size
    total = pages * page
    with backend.reserve(pages * page) as vrange:
        tensor = vrange.as_tensor()
        shmem_before = proc_kib("/proc/self/status", "RssShmem")
        rss_before = proc_kib("/proc/self/smaps_rollup", "Rss")

        vrange.commit(range(pages))
        tensor.fill_(0xA5)
        assert os.fstat(vrange.pool.fd).st_blocks * 512 == total
        assert vrange.footprint_bytes() == total
        shmem_grown = proc_kib("/proc/self/status", "RssShmem") - shmem_before
        rss_grown = proc_kib("/proc/self/smaps_rollup", "Rss") - rss_before
        assert shmem_grown >= total // 1024 - 1024
        assert rss_grown >= total // 1024 - 4096

        vrange.release(range(pages))
        assert os.fstat(vrange.pool.fd).st_blocks == 0
        assert vrange.footprint_bytes() == 0
        shmem_left = proc_kib("/proc/self/status", "RssShmem") - shmem_before
        rss_left = proc_kib("/proc/self/smaps_rollup", "Rss") - rss_before
        assert shmem_left <= 1024
        assert rss_left <= rss_grown - total // 1024 + 4096


def test_close_returns_everything(backend: HostBackend) -> None:
    vrange = backend.reserve(8 * backend.page_size)
    base = vrange.base_address
    vrange.commit([0, 1, 5])
    vrange.as_tensor()[: 2 * backend.page_size].fill_(1)
    witness = os.dup(vrange.pool.fd)
    try:
        assert os.fstat(witness).st_blocks * 512 == 3 * backend.page_size
        vrange.close()
        assert os.fstat(witness).st_blocks == 0
    finally:
        os.close(witness)
    assert vrange.closed
    assert vrange.pool.closed
    assert vrange.footprint_bytes() == 0
    assert vrange.committed_pages() == frozenset()
    gc.collect()
    assert mapped_span(base) is None, "the reservation is unmapped once nothing uses it"
    vrange.close()
    with pytest.raises(RangeClosedError):
        vrange.commit([0])
    with pytest.raises(RangeClosedError):
        vrange.release([0])
    with pytest.raises(RangeClosedError):
        vrange.as_tensor()


def test_live_tensor_keeps_the_reservation_until_dropped(backend: HostBackend) -> None:
    vrange = backend.reserve(2 * backend.page_size)
    base = vrange.base_address
    vrange.commit([0])
    tensor = vrange.as_tensor()
    view = tensor[10:20]
    del tensor
    vrange.close()
    span = mapped_span(base)
    assert span is not None
    assert span[2].startswith("---"), "a stale tensor must fault, not reach memory"
    del view
    gc.collect()
    assert mapped_span(base) is None


def test_out_of_range_pages_are_rejected_before_any_change(vrange: HostRange) -> None:
    with pytest.raises(PageIndexError, match=r"0\.\.15"):
        vrange.commit([0, 16])
    with pytest.raises(PageIndexError):
        vrange.commit([-1])
    with pytest.raises(IndexError):
        vrange.is_committed(16)
    assert vrange.committed_pages() == frozenset()
    assert vrange.footprint_bytes() == 0


def test_failed_commit_rolls_back_earlier_runs(
    vrange: HostRange, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = vrange.pool
    real_allocate = pool.allocate

    def allocate(first: int, count: int) -> None:
        if first == 8:
            raise OutOfPhysicalMemory("injected", errno=errno.ENOSPC)
        real_allocate(first, count)

    monkeypatch.setattr(pool, "allocate", allocate)
    vrange.commit([1])
    with pytest.raises(OutOfPhysicalMemory, match="injected"):
        vrange.commit([0, 1, 2, 5, 8, 9])
    assert vrange.committed_pages() == {1}
    assert vrange.footprint_bytes() == vrange.page_size


class FailingLibC(LibC):
    """Real libc except that ``fallocate`` fails with a chosen errno."""

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    def fallocate(self, fd: int, mode: int, offset: int, length: int) -> None:
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize(
    ("code", "error"),
    [(errno.ENOSPC, OutOfPhysicalMemory), (errno.ENOMEM, OutOfPhysicalMemory)],
)
def test_errno_becomes_a_clear_error(code: int, error: type[Exception]) -> None:
    pool = HostPool.create(4 << 20, page_size=2 << 20, libc=FailingLibC(code))
    with pool, pytest.raises(error, match="no physical memory") as info:
        pool.allocate(0, 1)
    assert getattr(info.value, "errno", None) == code


def test_other_errno_is_a_commit_or_release_error() -> None:
    pool = HostPool.create(4 << 20, page_size=2 << 20, libc=FailingLibC(errno.EINVAL))
    with pool:
        with pytest.raises(CommitError, match="EINVAL") as info:
            pool.allocate(0, 1)
        assert not isinstance(info.value, OutOfPhysicalMemory)
        with pytest.raises(ReleaseError, match="EINVAL"):
            pool.punch(0, 1)


def test_unmap_keeps_memory_in_the_pool(vrange: HostRange) -> None:
    tensor = vrange.as_tensor()
    vrange.commit([2])
    tensor[2 * vrange.page_size] = 42
    assert vrange.unmap([2, 3]) == 1
    assert not vrange.is_committed(2)
    assert vrange.footprint_bytes() == vrange.page_size
    assert vrange.commit([2]) == 1
    assert int(tensor[2 * vrange.page_size]) == 42, "recommit keeps pool contents"


def test_attach_in_process_shares_pages(backend: HostBackend, vrange: HostRange) -> None:
    vrange.commit([1])
    vrange.as_tensor()[vrange.page_size : vrange.page_size + 4].fill_(5)
    with backend.attach(vrange.pool.fd) as peer:
        assert peer.base_address != vrange.base_address
        assert peer.num_pages == vrange.num_pages
        assert peer.committed_pages() == frozenset()
        assert peer.commit([1]) == 1
        assert vrange.footprint_bytes() == vrange.page_size, "no new memory for a shared page"
        peer_tensor = peer.as_tensor()
        assert peer_tensor[peer.page_size : peer.page_size + 4].tolist() == [5, 5, 5, 5]
        peer.unmap([1])
    assert vrange.footprint_bytes() == vrange.page_size
    assert not vrange.pool.closed


def test_attach_validates_the_pool(backend: HostBackend) -> None:
    with backend.reserve(3 * backend.page_size) as vrange, pytest.raises(PageSizeError):
        HostBackend(page_size=2 * backend.page_size).attach(vrange.pool.fd)
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ReservationError, match="not a sized memory file"):
            backend.attach(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)
    with pytest.raises(ReservationError, match="cannot duplicate pool fd"):
        backend.attach(999999)


def test_pool_size_is_sealed(vrange: HostRange) -> None:
    with pytest.raises(PermissionError):
        os.ftruncate(vrange.pool.fd, vrange.page_size)
    with pytest.raises(PermissionError):
        os.ftruncate(vrange.pool.fd, 2 * vrange.size_bytes)


def test_non_strict_reads_zeros_from_uncommitted_pages() -> None:
    backend = HostBackend(strict=False)
    with backend.reserve(4 * backend.page_size) as vrange:
        assert not vrange.strict
        tensor = vrange.as_tensor()
        assert int(tensor[3 * backend.page_size :].max()) == 0
        assert vrange.footprint_bytes() == 0, "reading uncommitted pages allocates nothing"
        span = mapped_span(vrange.base_address + 3 * backend.page_size)
        assert span is not None
        assert span[2].startswith("r-"), "uncommitted pages are never writable"
        vrange.commit([0])
        tensor[0] = 3
        vrange.release([0])
        assert int(tensor[0]) == 0


def test_populate_commits_prefaulted_pages() -> None:
    backend = HostBackend(populate=True)
    with backend.reserve(2 * backend.page_size) as vrange:
        vrange.commit([0, 1])
        assert vrange.footprint_bytes() == 2 * backend.page_size
        tensor = vrange.as_tensor()
        tensor.fill_(8)
        assert int(tensor.sum()) == 8 * vrange.size_bytes


def test_small_pages_work() -> None:
    backend = HostBackend(page_size=4 * HostBackend().granularity)
    with backend.reserve(10 * backend.page_size) as vrange:
        vrange.commit([1, 2, 7])
        assert vrange.committed_bytes() == 3 * backend.page_size
        tensor = vrange.as_tensor()
        committed = tensor[backend.page_size : 3 * backend.page_size]
        committed.fill_(1)
        assert int(committed.sum()) == 2 * backend.page_size


def test_concurrent_commit_and_release_keep_bookkeeping_exact(vrange: HostRange) -> None:
    barrier = threading.Barrier(4)
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            barrier.wait()
            for step in range(200):
                pages = [(seed * 7 + step * k) % vrange.num_pages for k in (1, 3, 5)]
                if (step + seed) % 2:
                    vrange.commit(pages)
                else:
                    vrange.release(pages)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert vrange.footprint_bytes() == len(vrange.committed_pages()) * vrange.page_size
