"""CUDA backend without a GPU: a fake driver for the logic, the real package for availability.

The fake simulates what the backend relies on (address reservations, physical handles with a
device-memory budget, whole-mapping map/unmap, read-only or read-write access over mapped
ranges, a current context) and rejects misuse the real driver would reject, plus some it would
tolerate (releasing a mapped handle, unmapping several mappings in one call), so bookkeeping
bugs fail loudly. A handle may be mapped at several addresses, as on the real driver. The real
driver path (the cuda-bindings marshalling) is tested against a strict fake libcuda in
tests/cuda_fake, and on a GPU by the probe.
"""

from __future__ import annotations

import ctypes
import enum
import gc
import subprocess
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from elastickv.vmm import (
    BackendUnavailable,
    CommitError,
    OutOfPhysicalMemory,
    PageIndexError,
    PageSizeError,
    RangeClosedError,
    ReleaseError,
    ReservationError,
)
from elastickv.vmm.cuda import CudaBackend, CudaRange, Uncommitted
from elastickv.vmm.cuda_dlpack import KDL_CPU, byte_tensor, dlpack_capsule
from elastickv.vmm.cuda_driver import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CudaDriver,
    CudaDriverError,
    check,
    error_from,
)

MiB = 1 << 20
GRAN = 2 * MiB
INVALID_VALUE = 1
ERRORS = {
    INVALID_VALUE: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    CUDA_ERROR_OUT_OF_MEMORY: ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
}


class FakeDriver:
    """Simulated CUDA VMM driver state; ``fail(call, code, after=n)`` fails the (n+1)-th call."""

    def __init__(self, *, granularity: int = GRAN, total: int = 64 * GRAN, device: int = 0):
        self._granularity = granularity
        self.total = total
        self._device = device
        self.calls: Counter[str] = Counter()
        self.reservations: dict[int, int] = {}
        self.handles: dict[int, int] = {}
        self.mappings: dict[int, tuple[int, int]] = {}
        self.readable: set[int] = set()
        self.writable: set[int] = set()
        self.access_ranges: list[tuple[int, int]] = []
        self._next_address = 0x7F00_0000_0000
        self._next_handle = 1
        self._depth = 0
        self._failures: dict[str, tuple[int, int]] = {}

    @property
    def device(self) -> int:
        return self._device

    def uuid(self) -> str:
        return f"GPU-00000000-0000-0000-0000-{self._device:012d}"

    def fail(self, call: str, code: int = INVALID_VALUE, *, after: int = 0) -> None:
        self._failures[call] = (after, code)

    @contextmanager
    def current(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _enter(self, call: str) -> None:
        assert self._depth > 0, f"{call} called without a current context"
        self.calls[call] += 1
        if call in self._failures:
            after, code = self._failures[call]
            if after == 0:
                del self._failures[call]
                self._raise(call, code)
            self._failures[call] = (after - 1, code)

    @staticmethod
    def _raise(call: str, code: int) -> None:
        name, text = ERRORS[code]
        raise CudaDriverError(call, code, name, text)

    def used(self) -> int:
        return sum(self.handles.values())

    def granularity(self) -> int:
        self._enter("cuMemGetAllocationGranularity")
        return self._granularity

    def address_reserve(self, size: int, alignment: int) -> int:
        self._enter("cuMemAddressReserve")
        if size % self._granularity:
            self._raise("cuMemAddressReserve", INVALID_VALUE)
        align = max(alignment, self._granularity)
        address = -(-self._next_address // align) * align
        self._next_address = address + size + self._granularity
        self.reservations[address] = size
        return address

    def address_free(self, address: int, size: int) -> None:
        self._enter("cuMemAddressFree")
        if self.reservations.get(address) != size:
            self._raise("cuMemAddressFree", INVALID_VALUE)
        if any(address <= a < address + size for a in self.mappings):
            self._raise("cuMemAddressFree", INVALID_VALUE)
        del self.reservations[address]

    def create(self, size: int) -> int:
        self._enter("cuMemCreate")
        if size % self._granularity:
            self._raise("cuMemCreate", INVALID_VALUE)
        if self.used() + size > self.total:
            self._raise("cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY)
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = size
        return handle

    def release(self, handle: int) -> None:
        self._enter("cuMemRelease")
        if handle not in self.handles or any(h == handle for _, h in self.mappings.values()):
            self._raise("cuMemRelease", INVALID_VALUE)
        del self.handles[handle]

    def map(self, address: int, size: int, handle: int) -> None:
        self._enter("cuMemMap")
        inside = any(a <= address and address + size <= a + n for a, n in self.reservations.items())
        overlaps = any(
            a < address + size and address < a + n for a, (n, _) in self.mappings.items()
        )
        if not inside or overlaps or self.handles.get(handle) != size:
            self._raise("cuMemMap", INVALID_VALUE)
        self.mappings[address] = (size, handle)

    def set_access(self, address: int, size: int, *, read_only: bool = False) -> None:
        self._enter("cuMemSetAccess")
        covered = 0
        for a in sorted(self.mappings):
            n, _ = self.mappings[a]
            if address <= a < address + size:
                covered += n
        if covered != size:
            self._raise("cuMemSetAccess", INVALID_VALUE)
        self.access_ranges.append((address, size))
        inside = {a for a in self.mappings if address <= a < address + size}
        self.readable.update(inside)
        if read_only:
            self.writable.difference_update(inside)
        else:
            self.writable.update(inside)

    def unmap(self, address: int, size: int) -> None:
        self._enter("cuMemUnmap")
        if self.mappings.get(address, (None, None))[0] != size:
            self._raise("cuMemUnmap", INVALID_VALUE)
        del self.mappings[address]
        self.readable.discard(address)
        self.writable.discard(address)

    def mem_get_info(self) -> tuple[int, int]:
        self._enter("cuMemGetInfo")
        return self.total - self.used(), self.total

    def synchronize(self, stream: int | None) -> None:
        self._enter("cuCtxSynchronize" if stream is None else "cuStreamSynchronize")

    def zero(self, address: int, size: int, stream: int | None) -> None:
        self._enter("cuMemsetD8Async")
        if address not in self.writable:
            self._raise("cuMemsetD8Async", INVALID_VALUE)

    def read(self, address: int, size: int) -> bytes:
        self._enter("cuMemcpyDtoH")
        if address not in self.readable:
            self._raise("cuMemcpyDtoH", INVALID_VALUE)
        return bytes(size)  # no memory contents here: tests/cuda_fake checks real bytes

    def empty(self) -> bool:
        return not (self.reservations or self.handles or self.mappings)


@pytest.fixture
def fake() -> FakeDriver:
    return FakeDriver()


def make(
    fake: FakeDriver, pool: int = 8, page_size: int = GRAN, uncommitted: Uncommitted = "fault"
) -> CudaBackend:
    """Fault mode by default here: these tests count the mappings of committed pages only."""
    return CudaBackend(
        page_size=page_size, handle_pool_size=pool, driver=fake, uncommitted=uncommitted
    )


@pytest.fixture
def vrange(fake: FakeDriver) -> Iterator[CudaRange]:
    with make(fake).reserve(32 * GRAN) as reserved:
        yield reserved


def mapped_pages(fake: FakeDriver, vrange: CudaRange) -> set[int]:
    return {(a - vrange.base_address) // vrange.page_size for a in fake.mappings}


# -- construction and validation ------------------------------------------------------------


def test_granularity_and_page_size_validation(fake: FakeDriver) -> None:
    backend = make(fake, page_size=4 * MiB)
    assert backend.granularity == GRAN
    assert backend.page_size == 4 * MiB
    assert backend.device_type == "cuda"
    with pytest.raises(PageSizeError, match="granularity"):
        make(fake, page_size=3 * MiB)
    with pytest.raises(PageSizeError):
        make(FakeDriver(granularity=4 * MiB), page_size=GRAN)


def test_options_are_checked(fake: FakeDriver) -> None:
    assert CudaBackend(driver=fake).uncommitted == "zero"
    assert not CudaBackend(driver=fake).strict
    assert CudaBackend(strict=True, driver=fake).uncommitted == "fault"
    assert CudaBackend(strict=False, driver=fake).uncommitted == "zero"
    assert CudaBackend(uncommitted="fault", strict=True, driver=fake).strict
    with pytest.raises(ValueError, match="contradicts strict"):
        CudaBackend(uncommitted="zero", strict=True, driver=fake)
    with pytest.raises(ValueError, match="uncommitted must be one of 'zero', 'fault'"):
        CudaBackend(uncommitted="zeros", driver=fake)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="handle_pool_size"):
        CudaBackend(handle_pool_size=-1, driver=fake)
    with pytest.raises(ValueError, match="size_bytes"):
        make(fake).reserve(0)


@pytest.mark.parametrize("page_size", [2 * MiB, 4 * MiB, 6 * MiB])
def test_reserve_rounds_up_and_aligns(fake: FakeDriver, page_size: int) -> None:
    with make(fake, page_size=page_size).reserve(5 * page_size + 1) as vrange:
        assert vrange.num_pages == 6
        assert vrange.size_bytes == 6 * page_size
        assert vrange.base_address % page_size == 0
        assert vrange.strict
        assert vrange.info.backend == "cuda"
        assert vrange.footprint_bytes() == 0
        vrange.commit([0, 5])
        assert mapped_pages(fake, vrange) == {0, 5}
    assert fake.empty()


def test_reservation_failure_names_the_driver_error(fake: FakeDriver) -> None:
    fake.fail("cuMemAddressReserve")
    with pytest.raises(ReservationError, match="CUDA_ERROR_INVALID_VALUE"):
        make(fake).reserve(4 * GRAN)


def test_granularity_failure_is_unavailable(fake: FakeDriver) -> None:
    fake.fail("cuMemGetAllocationGranularity")
    with pytest.raises(BackendUnavailable, match=r"CUDA_ERROR_INVALID_VALUE \(invalid argument\)"):
        make(fake)


# -- commit / release ----------------------------------------------------------------------


def test_commit_release_bookkeeping(fake: FakeDriver, vrange: CudaRange) -> None:
    assert vrange.commit([6, 0, 1, 2, 5]) == 5
    assert vrange.commit([0, 1]) == 0
    assert vrange.committed_pages() == {0, 1, 2, 5, 6}
    assert mapped_pages(fake, vrange) == {0, 1, 2, 5, 6}
    assert len(fake.readable) == 5
    assert vrange.footprint_bytes() == vrange.committed_bytes() == 5 * GRAN
    assert vrange.release([1, 5, 9]) == 2
    assert mapped_pages(fake, vrange) == {0, 2, 6}
    assert vrange.footprint_bytes() == 3 * GRAN
    with pytest.raises(PageIndexError):
        vrange.commit([32])


def test_set_access_once_per_contiguous_run(fake: FakeDriver, vrange: CudaRange) -> None:
    vrange.commit([0, 1, 2, 3, 10, 11, 20])
    base = vrange.base_address
    assert fake.access_ranges == [
        (base, 4 * GRAN),
        (base + 10 * GRAN, 2 * GRAN),
        (base + 20 * GRAN, GRAN),
    ]
    assert vrange.set_access_calls == 3
    assert fake.calls["cuMemMap"] == 7
    vrange.release(range(0, 32))
    assert fake.calls["cuMemUnmap"] == 7


def test_handle_pool_reuses_released_handles(fake: FakeDriver, vrange: CudaRange) -> None:
    vrange.commit(range(4))
    assert fake.calls["cuMemCreate"] == 4
    vrange.release(range(4))
    assert vrange.pool.idle == 4
    assert vrange.footprint_bytes() == 0
    assert vrange.held_bytes() == 4 * GRAN
    assert len(fake.handles) == 4
    vrange.commit([10, 11, 12, 13, 14])
    assert fake.calls["cuMemCreate"] == 5
    assert vrange.pool.reused == 4
    assert vrange.pool.idle == 0


def test_handle_pool_is_bounded(fake: FakeDriver) -> None:
    with make(fake, pool=2).reserve(16 * GRAN) as vrange:
        vrange.commit(range(6))
        vrange.release(range(6))
        assert vrange.pool.idle == 2
        assert len(fake.handles) == 2
        assert fake.calls["cuMemRelease"] == 4
        assert vrange.trim_pool() == 2 * GRAN
        assert not fake.handles


def test_no_pool_releases_at_once(fake: FakeDriver) -> None:
    with make(fake, pool=0).reserve(8 * GRAN) as vrange:
        vrange.commit(range(3))
        vrange.release(range(3))
        assert not fake.handles
        assert vrange.held_bytes() == 0


def test_fill_pool_precreates_handles(fake: FakeDriver) -> None:
    with make(fake, pool=3).reserve(8 * GRAN) as vrange:
        assert vrange.fill_pool(5) == 3
        assert vrange.fill_pool(2) == 0
        created = fake.calls["cuMemCreate"]
        vrange.commit(range(3))
        assert fake.calls["cuMemCreate"] == created
        assert vrange.pool.idle == 0


def test_footprint_matches_device_memory_delta(fake: FakeDriver, vrange: CudaRange) -> None:
    backend = make(fake)
    free_before, total = backend.mem_get_info()
    vrange.commit(range(7))
    vrange.release([5, 6])
    free_after, _ = backend.mem_get_info()
    assert total == fake.total
    assert free_before - free_after == vrange.held_bytes() == vrange.footprint_bytes() + 2 * GRAN


def test_zero_mode_maps_one_read_only_page_under_uncommitted_pages(fake: FakeDriver) -> None:
    """This fake refuses an unmap spanning several mappings, so the close falls back to one
    unmap per zero-page mapping and still returns everything."""
    with make(fake, uncommitted="zero").reserve(8 * GRAN) as vrange:
        base = vrange.base_address
        zero = {handle for _, handle in fake.mappings.values()}
        assert len(zero) == 1 and len(fake.mappings) == 8 + 1  # the pages and the window
        assert not fake.writable, "the zero page is read-only"
        vrange.commit([2, 3])
        handles = [fake.mappings[base + page * GRAN][1] for page in range(8)]
        assert len({handles[2], handles[3]} - zero) == 2
        assert {handles[page] for page in (0, 1, 4, 5, 6, 7)} == zero
        assert fake.writable == {base + 2 * GRAN, base + 3 * GRAN}
        assert vrange.footprint_bytes() == 2 * GRAN
        assert vrange.held_bytes() == 3 * GRAN
        vrange.release([2])
        assert fake.mappings[base + 2 * GRAN][1] in zero
        assert vrange.check_zero_page() is False
    assert fake.empty()


# -- failures and rollback -----------------------------------------------------------------


def test_out_of_memory_midway_rolls_back(fake: FakeDriver) -> None:
    fake.total = 4 * GRAN
    with make(fake, pool=8).reserve(16 * GRAN) as vrange:
        vrange.commit([15])
        with pytest.raises(OutOfPhysicalMemory) as info:
            vrange.commit([0, 1, 2, 8, 9, 10])
        message = str(info.value)
        assert "CUDA_ERROR_OUT_OF_MEMORY" in message
        assert "out of memory" in message
        assert "cuMemCreate" in message
        assert vrange.committed_pages() == {15}
        assert mapped_pages(fake, vrange) == {15}
        assert vrange.footprint_bytes() == GRAN
        assert len(fake.handles) == 1 + vrange.pool.idle
        vrange.trim_pool()
        vrange.commit([0, 1, 2])
        assert mapped_pages(fake, vrange) == {0, 1, 2, 15}


def test_out_of_memory_with_no_pool_frees_everything(fake: FakeDriver) -> None:
    fake.total = 3 * GRAN
    with make(fake, pool=0).reserve(16 * GRAN) as vrange:
        with pytest.raises(OutOfPhysicalMemory):
            vrange.commit([0, 1, 5, 6])
        assert not fake.mappings
        assert not fake.handles


def test_map_failure_midway_is_commit_error(fake: FakeDriver, vrange: CudaRange) -> None:
    fake.fail("cuMemMap", after=4)
    with pytest.raises(CommitError) as info:
        vrange.commit([0, 1, 2, 3, 4, 5, 6])
    assert not isinstance(info.value, OutOfPhysicalMemory)
    assert "cuMemMap returned CUDA_ERROR_INVALID_VALUE (invalid argument)" in str(info.value)
    assert not fake.mappings
    assert vrange.committed_pages() == frozenset()


def test_set_access_failure_unmaps_the_run(fake: FakeDriver, vrange: CudaRange) -> None:
    vrange.commit([0, 1])
    fake.fail("cuMemSetAccess")
    with pytest.raises(CommitError, match="cuMemSetAccess"):
        vrange.commit([5, 6, 7])
    assert mapped_pages(fake, vrange) == {0, 1}
    vrange.commit([5, 6, 7])
    assert mapped_pages(fake, vrange) == {0, 1, 5, 6, 7}


def test_unmap_failure_keeps_the_run_committed(fake: FakeDriver, vrange: CudaRange) -> None:
    vrange.commit([0, 1, 2, 3])
    fake.fail("cuMemUnmap", after=2)
    with pytest.raises(ReleaseError, match="retry the release"):
        vrange.release([0, 1, 2, 3])
    assert vrange.committed_pages() == {0, 1, 2, 3}
    assert mapped_pages(fake, vrange) == {0, 1, 2, 3}
    assert len(fake.readable) == 4
    assert vrange.release([0, 1, 2, 3]) == 4
    assert not fake.mappings


# -- teardown ------------------------------------------------------------------------------


def test_close_returns_everything_and_is_idempotent(fake: FakeDriver) -> None:
    vrange = make(fake).reserve(16 * GRAN)
    vrange.commit([0, 1, 7])
    vrange.release([7])
    vrange.fill_pool(4)
    vrange.close()
    assert fake.empty()
    assert vrange.closed
    assert vrange.footprint_bytes() == 0
    vrange.close()
    with pytest.raises(RangeClosedError):
        vrange.commit([0])
    with pytest.raises(RangeClosedError):
        vrange.fill_pool(1)


def test_close_reports_a_refused_release_but_finishes(fake: FakeDriver) -> None:
    vrange = make(fake, pool=4).reserve(8 * GRAN)
    vrange.commit([0, 1])
    vrange.release([1])
    fake.fail("cuMemRelease")
    with pytest.raises(ReleaseError, match="unreleased"):
        vrange.close()
    assert vrange.closed
    assert not fake.mappings
    assert not fake.reservations
    assert len(fake.handles) == 1


def test_unclosed_range_is_cleaned_up_when_collected(fake: FakeDriver) -> None:
    vrange = make(fake).reserve(8 * GRAN)
    vrange.commit([0, 3])
    vrange.release([3])
    ref = weakref.ref(vrange)
    del vrange
    gc.collect()
    assert ref() is None
    assert fake.empty()


# -- errors from the real bindings layer ---------------------------------------------------


class _Result(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2


class _StubModule:
    """Just the two error-description calls ``check`` uses."""

    def __init__(self, *, broken: bool = False) -> None:
        self.broken = broken

    def cuGetErrorName(self, code: Any) -> tuple[Any, bytes]:
        if self.broken:
            raise RuntimeError("libcuda not found")
        return _Result.CUDA_SUCCESS, b"CUDA_ERROR_OUT_OF_MEMORY"

    def cuGetErrorString(self, code: Any) -> tuple[Any, bytes]:
        if self.broken:
            raise RuntimeError("libcuda not found")
        return _Result.CUDA_SUCCESS, b"out of memory"


def test_check_unpacks_results() -> None:
    stub = _StubModule()
    assert check(stub, "cuInit", (_Result.CUDA_SUCCESS,)) is None
    assert check(stub, "cuDeviceGet", (_Result.CUDA_SUCCESS, 3)) == 3
    assert check(stub, "cuMemGetInfo", (_Result.CUDA_SUCCESS, 1, 2)) == (1, 2)


def test_check_raises_with_driver_name_and_text() -> None:
    with pytest.raises(CudaDriverError) as info:
        check(_StubModule(), "cuMemCreate", (_Result.CUDA_ERROR_OUT_OF_MEMORY, None))
    error = info.value
    assert str(error) == "cuMemCreate returned CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
    assert error.out_of_memory
    assert error.code == CUDA_ERROR_OUT_OF_MEMORY


def test_error_name_falls_back_to_the_enum() -> None:
    error = error_from(_StubModule(broken=True), "cuMemMap", _Result.CUDA_ERROR_OUT_OF_MEMORY)
    assert error.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "no description" in error.text


def test_real_enum_translation() -> None:
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver

    code = driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    error = error_from(_StubModule(broken=True), "cuMemCreate", code)
    assert error.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert error.out_of_memory


# -- the real package on this machine ------------------------------------------------------


def _real_backend_or_error() -> BackendUnavailable:
    try:
        CudaBackend()
    except BackendUnavailable as exc:
        return exc
    pytest.skip("a CUDA device is available here; the GPU probe covers the real path")


def test_real_backend_is_unavailable_without_a_gpu() -> None:
    pytest.importorskip("cuda.bindings")
    error = _real_backend_or_error()
    message = str(error)
    assert "driver" in message
    assert "GPU" in message


def test_missing_package_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    with pytest.raises(BackendUnavailable, match=r"pip install 'elastickv\[cuda\]'"):
        CudaDriver()
    assert not CudaBackend.is_available()


def test_importing_the_backend_does_not_import_cuda() -> None:
    code = (
        "import sys, elastickv, elastickv.vmm, elastickv.vmm.cuda;"
        "assert not any(m.startswith('cuda') for m in sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class _NoDeviceProxy:
    """Real ``cuda.bindings.driver`` whose start-up calls pretend a device is present."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def cuInit(self, flags: int) -> tuple[Any]:
        return (self._real.CUresult.CUDA_SUCCESS,)

    def cuDeviceGetCount(self) -> tuple[Any, int]:
        return self._real.CUresult.CUDA_SUCCESS, 1

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, Any]:
        return self._real.CUresult.CUDA_SUCCESS, self._real.CUdevice(ordinal)

    def cuDeviceGetAttribute(self, attribute: Any, device: Any) -> tuple[Any, int]:
        return self._real.CUresult.CUDA_SUCCESS, 1

    def cuDevicePrimaryCtxRetain(self, device: Any) -> tuple[Any, Any]:
        return self._real.CUresult.CUDA_SUCCESS, self._real.CUcontext(0)

    def cuDevicePrimaryCtxRelease(self, device: Any) -> tuple[Any]:
        return (self._real.CUresult.CUDA_SUCCESS,)


def test_real_bindings_accept_our_arguments() -> None:
    """Each wrapper builds arguments the bindings accept: a bad type would be a TypeError before
    the bindings try (and here fail) to load libcuda."""
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver as real

    try:
        real.cuInit(0)
    except RuntimeError:
        pass
    else:
        pytest.skip("libcuda is present; the GPU probe covers the real calls")
    cuda = CudaDriver(0, module=_NoDeviceProxy(real))
    calls: list[Callable[[], object]] = [
        cuda.granularity,
        lambda: cuda.address_reserve(4 * GRAN, GRAN),
        lambda: cuda.address_free(0x7F00_0000_0000, 4 * GRAN),
        lambda: cuda.create(GRAN),
        lambda: cuda.release(1),
        lambda: cuda.map(0x7F00_0000_0000, GRAN, 1),
        lambda: cuda.set_access(0x7F00_0000_0000, GRAN),
        lambda: cuda.set_access(0x7F00_0000_0000, GRAN, read_only=True),
        lambda: cuda.read(0x7F00_0000_0000, 64),
        cuda.uuid,
        lambda: cuda.unmap(0x7F00_0000_0000, GRAN),
        cuda.mem_get_info,
        lambda: cuda.synchronize(None),
        lambda: cuda.synchronize(0x1234),
        lambda: cuda.zero(0x7F00_0000_0000, GRAN, None),
    ]
    for call in calls:
        # The text differs between releases (13.x: pathfinder's "driver library", 12.8:
        # 'Function "cuMemMap" not found'); the point is that no TypeError came first.
        with pytest.raises(RuntimeError):
            call()
    cuda.close()


# -- zero-copy tensors ---------------------------------------------------------------------


class _Owner:
    pass


def test_dlpack_tensor_is_zero_copy_and_keeps_its_owner() -> None:
    buffer = (ctypes.c_uint8 * 4096)()
    owner = _Owner()
    alive = weakref.ref(owner)
    tensor = byte_tensor(
        ctypes.addressof(buffer), 4096, device_type=KDL_CPU, device_id=0, keepalive=owner
    )
    del owner
    assert tensor.shape == (4096,)
    assert tensor.data_ptr() == ctypes.addressof(buffer)
    tensor[100] = 42
    assert buffer[100] == 42
    gc.collect()
    assert alive() is not None
    del tensor
    gc.collect()
    assert alive() is None


def test_unconsumed_capsule_releases_its_owner() -> None:
    buffer = (ctypes.c_uint8 * 16)()
    owner = _Owner()
    alive = weakref.ref(owner)
    capsule = dlpack_capsule(
        ctypes.addressof(buffer), 16, device_type=KDL_CPU, device_id=0, keepalive=owner
    )
    del owner
    assert alive() is not None
    del capsule
    gc.collect()
    assert alive() is None
