"""CudaBackend over the real cuda-bindings and the strict fake driver, in both modes.

Every driver call here crosses the bindings' real marshalling into C; the fake refuses what the
VMM rules forbid, and the autouse fixture fails any test that leaves a handle, mapping or
reservation behind. The guarantees (zeroing, synchronisation, interrupts, failures) are checked
with uncommitted pages on the shared zero page (the default) and unmapped (``fault``); what only
one mode does is tested below them, and the zero page's own behaviour in
test_cuda_fake_zero_page.py.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fakecuda_lib import CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_OUT_OF_MEMORY, FakeCuda
from pages import assert_consistent

from elastickv.vmm import (
    BackendUnavailable,
    CommitError,
    DeviceFault,
    OutOfPhysicalMemory,
    ReleaseError,
)
from elastickv.vmm.cuda import UNCOMMITTED_MODES, CudaBackend, CudaRange, Uncommitted
from elastickv.vmm.cuda_driver import CudaDriver

MiB = 1 << 20
PAGE = 2 * MiB


@pytest.fixture(params=UNCOMMITTED_MODES)
def mode(request: pytest.FixtureRequest) -> Uncommitted:
    value: Uncommitted = request.param
    return value


@pytest.fixture
def backend(mode: Uncommitted) -> Iterator[CudaBackend]:
    made = CudaBackend(page_size=PAGE, handle_pool_size=4, uncommitted=mode)
    yield made
    driver = made.driver
    assert isinstance(driver, CudaDriver)
    driver.close()


@pytest.fixture
def vrange(backend: CudaBackend) -> Iterator[CudaRange]:
    with backend.reserve(8 * PAGE) as reserved:
        yield reserved


def interrupt_on(
    monkeypatch: pytest.MonkeyPatch, backend: CudaBackend, method: str, nth: int, *, after: bool
) -> None:
    """Raise KeyboardInterrupt on the ``nth`` call of ``driver.<method>``, before the driver
    call or just after it succeeded (as a Ctrl-C between the C call and our bookkeeping)."""
    driver = backend.driver
    real: Callable[..., Any] = getattr(driver, method)
    seen = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal seen
        seen += 1
        if seen == nth and not after:
            raise KeyboardInterrupt
        value = real(*args, **kwargs)
        if seen == nth:
            raise KeyboardInterrupt
        return value

    monkeypatch.setattr(driver, method, wrapper)


def zero_pages(vrange: CudaRange) -> int:
    """Physical pages the zero page adds in the driver (0 or 1)."""
    return 1 if vrange.uncommitted == "zero" else 0


# -- the marshalling, end to end ------------------------------------------------------------


def test_bindings_version_is_the_one_make_asked_for() -> None:
    from cuda.bindings import __version__

    expected = os.environ.get("ELASTICKV_EXPECT_CUDA_BINDINGS")
    assert expected in (None, str(__version__)), f"imported cuda-bindings {__version__}"


def test_round_trip_through_the_real_bindings(fake: FakeCuda, backend: CudaBackend) -> None:
    assert backend.granularity == PAGE
    free, total = backend.mem_get_info()
    assert free == total == 64 << 30
    with backend.reserve(5 * PAGE + 1) as vrange:
        zero = zero_pages(vrange)
        # The zero page is mapped at all 6 pages and at its window past the range.
        idle_mappings = 7 * zero
        assert fake.live() == {"handles": zero, "mappings": idle_mappings, "reservations": 1}
        assert vrange.num_pages == 6
        assert vrange.base_address % PAGE == 0
        assert vrange.commit([0, 1, 4]) == 3
        assert fake.live() == {"handles": 3 + zero, "mappings": 7 if zero else 3, "reservations": 1}
        assert_consistent(fake, vrange)
        tensor = vrange.as_tensor()
        tensor[: 2 * PAGE] = 7
        tensor[4 * PAGE] = 9
        assert int(tensor[2 * PAGE - 1]) == 7 and int(tensor[4 * PAGE]) == 9
        used = (3 + zero) * PAGE
        assert backend.mem_get_info()[0] == total - used == total - fake.used_bytes()
        assert vrange.release([1, 4]) == 2
        assert fake.live() == {"handles": 3 + zero, "mappings": 7 if zero else 1, "reservations": 1}
        assert vrange.held_bytes() == (3 + zero) * PAGE
        assert vrange.footprint_bytes() == PAGE
        assert_consistent(fake, vrange)
        del tensor
    assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 0}
    assert fake.context_depth() == 0


def test_primary_context_is_released(fake: FakeCuda) -> None:
    driver = CudaDriver(0)
    assert fake.primary_retains() == 1
    driver.close()
    assert fake.primary_retains() == 0


def test_granularity_and_odd_page_sizes(fake: FakeCuda, mode: Uncommitted) -> None:
    """6 MiB pages: the driver only takes power-of-two alignments, so the range over-reserves
    and starts at a 6 MiB multiple; the fake refuses any map outside the reservation."""
    backend = CudaBackend(page_size=3 * PAGE, uncommitted=mode)
    with backend.reserve(5 * 3 * PAGE) as vrange:
        assert vrange.base_address % (3 * PAGE) == 0
        assert_consistent(fake, vrange)
        vrange.commit([1, 3])
        assert_consistent(fake, vrange)
        vrange.commit(range(vrange.num_pages))
        assert fake.live()["mappings"] == 5 + zero_pages(vrange)
        vrange.as_tensor()[-1] = 1
        vrange.release([0, 4])
        assert_consistent(fake, vrange)
    assert fake.calls("cuMemAddressReserve") >= 1


def test_device_without_vmm_support_is_unavailable(fake: FakeCuda) -> None:
    fake.set_vmm_supported(False)
    creates = fake.calls("cuMemCreate")
    with pytest.raises(BackendUnavailable, match="VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
        CudaBackend()
    assert fake.calls("cuMemCreate") == creates
    assert fake.primary_retains() == 0


def test_missing_device_is_unavailable(fake: FakeCuda) -> None:
    with pytest.raises(BackendUnavailable, match="does not exist; the driver sees 1"):
        CudaBackend(device=1)


def test_access_goes_to_the_owning_device_only(fake: FakeCuda, mode: Uncommitted) -> None:
    fake.set_device_count(2)
    with CudaBackend(uncommitted=mode).reserve(2 * PAGE) as vrange:
        assert fake.last_access_devices() == ([0] if mode == "zero" else [])  # the zero page
        vrange.commit([0, 1])
        assert fake.last_access_devices() == [0]
        vrange.release([1])
        assert fake.last_access_devices() == [0]


# -- zeroing --------------------------------------------------------------------------------


def test_committed_pages_read_zero_fresh_and_reused(fake: FakeCuda, vrange: CudaRange) -> None:
    """The fake fills new physical memory with 0xFF (NaN as fp32), like stale device memory."""
    vrange.commit([0, 1])
    tensor = vrange.as_tensor()
    assert int(tensor[: 2 * PAGE].max()) == 0
    tensor[: 2 * PAGE] = 0xAB
    vrange.release([0, 1])
    assert vrange.pool.idle == 2
    zeroed = fake.calls("cuMemsetD8Async")
    vrange.commit([5, 6])
    assert vrange.pool.reused == 2
    assert int(tensor[5 * PAGE : 7 * PAGE].max()) == 0
    assert fake.calls("cuMemsetD8Async") == zeroed + 1  # one per contiguous run


# -- synchronisation ------------------------------------------------------------------------


def test_release_waits_for_queued_kernels(fake: FakeCuda, vrange: CudaRange) -> None:
    vrange.commit([0, 1, 2])
    assert fake.launch(vrange.base_address, 3 * PAGE) == 0
    assert fake.pending_kernels() == 1
    vrange.release([1])
    assert fake.sticky_error() == 0, "a queued kernel saw its page unmapped"
    assert fake.pending_kernels() == 0


def test_close_waits_for_queued_kernels(fake: FakeCuda, backend: CudaBackend) -> None:
    vrange = backend.reserve(4 * PAGE)
    vrange.commit(range(4))
    fake.launch(vrange.base_address, 4 * PAGE)
    vrange.close()
    assert fake.sticky_error() == 0


def test_caller_stream_is_what_the_backend_waits_on(fake: FakeCuda, mode: Uncommitted) -> None:
    backend = CudaBackend(sync_stream=0x5000, uncommitted=mode)
    contexts = fake.calls("cuCtxSynchronize")
    streams = fake.calls("cuStreamSynchronize")
    with backend.reserve(2 * PAGE) as vrange:
        vrange.commit([0])
        fake.launch(vrange.base_address, PAGE)
        vrange.release([0])
    assert fake.sticky_error() == 0
    assert fake.calls("cuStreamSynchronize") >= streams + 2  # zeroing, then the release
    assert fake.calls("cuCtxSynchronize") == contexts + 1  # only the reservation's free


def test_tensor_outliving_the_range_frees_the_address_after_a_sync(
    fake: FakeCuda, backend: CudaBackend
) -> None:
    vrange = backend.reserve(2 * PAGE)
    vrange.commit([0])
    tensor = vrange.as_tensor()
    vrange.close()
    assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 1}
    syncs = fake.calls("cuCtxSynchronize")
    del tensor
    gc.collect()
    assert fake.live()["reservations"] == 0
    assert fake.calls("cuCtxSynchronize") == syncs + 1


def test_unclosed_range_is_returned_when_collected(fake: FakeCuda, backend: CudaBackend) -> None:
    vrange = backend.reserve(4 * PAGE)
    vrange.commit([0, 2])
    vrange.release([2])
    del vrange
    gc.collect()
    assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 0}


# -- failures and interrupts ----------------------------------------------------------------


@pytest.mark.parametrize("after", [False, True], ids=["before-the-call", "after-the-call"])
def test_interrupted_commit_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeCuda,
    backend: CudaBackend,
    vrange: CudaRange,
    after: bool,
) -> None:
    """The audit's case: Ctrl-C on the 3rd cuMemMap of a 4-page commit."""
    interrupt_on(monkeypatch, backend, "map", 3, after=after)
    with pytest.raises(KeyboardInterrupt):
        vrange.commit(range(4))
    assert vrange.committed_pages() == frozenset()
    assert_consistent(fake, vrange)
    assert vrange.pool.idle == 4
    monkeypatch.undo()
    assert vrange.commit([0]) == 1
    assert_consistent(fake, vrange)


@pytest.mark.parametrize(
    "method,after",
    [
        # After cuMemCreate returned, an interrupt loses the new handle with Python's frame.
        ("create", False),
        *((m, a) for m in ("unmap", "set_access", "zero") for a in (False, True)),
    ],
)
def test_commit_interrupted_elsewhere_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeCuda,
    backend: CudaBackend,
    vrange: CudaRange,
    method: str,
    after: bool,
) -> None:
    """``unmap`` is the zero page's unmap in zero mode (fault mode has none: nothing to stop)."""
    vrange.commit([7])
    interrupt_on(monkeypatch, backend, method, 1 if method != "create" else 2, after=after)
    if method == "unmap" and vrange.uncommitted == "fault":
        assert vrange.commit(range(3)) == 3
        monkeypatch.undo()
        return
    with pytest.raises(KeyboardInterrupt):
        vrange.commit(range(3))
    monkeypatch.undo()
    assert vrange.committed_pages() == {7}
    assert_consistent(fake, vrange)
    assert vrange.commit(range(3)) == 3
    assert_consistent(fake, vrange)


@pytest.mark.parametrize("nth", [1, 3])
def test_driver_error_midway_rolls_back(fake: FakeCuda, vrange: CudaRange, nth: int) -> None:
    fake.fail("cuMemMap", nth=nth)
    with pytest.raises(CommitError, match=r"cuMemMap returned CUDA_ERROR_INVALID_VALUE"):
        vrange.commit(range(4))
    assert vrange.committed_pages() == frozenset()
    assert_consistent(fake, vrange)
    vrange.commit(range(4))
    assert_consistent(fake, vrange)


@pytest.mark.parametrize(
    "call,nth", [("cuMemUnmap", 2), ("cuMemSetAccess", 1), ("cuMemsetD8Async", 1)]
)
def test_other_driver_errors_in_a_commit_roll_back(
    fake: FakeCuda, vrange: CudaRange, call: str, nth: int
) -> None:
    """``cuMemUnmap`` in a commit is the zero page's (zero mode only)."""
    vrange.commit([0])
    fake.fail(call, nth=nth)
    if call == "cuMemUnmap" and vrange.uncommitted == "fault":
        assert vrange.commit(range(2, 6)) == 4  # no unmap in a fault-mode commit
        fake.disarm(call)
        return
    with pytest.raises(CommitError, match=call):
        vrange.commit(range(2, 6))
    assert vrange.committed_pages() == {0}
    assert_consistent(fake, vrange)


def test_interrupt_in_a_later_run_rolls_back_the_earlier_runs(
    monkeypatch: pytest.MonkeyPatch, fake: FakeCuda, backend: CudaBackend, vrange: CudaRange
) -> None:
    interrupt_on(monkeypatch, backend, "map", 3, after=False)
    with pytest.raises(KeyboardInterrupt):
        vrange.commit([0, 1, 4, 5])
    monkeypatch.undo()
    assert vrange.committed_pages() == frozenset()
    assert_consistent(fake, vrange)


def test_out_of_device_memory(fake: FakeCuda, vrange: CudaRange) -> None:
    zero = zero_pages(vrange)
    fake.set_total_memory((3 + zero) * PAGE)
    with pytest.raises(OutOfPhysicalMemory, match="CUDA_ERROR_OUT_OF_MEMORY"):
        vrange.commit(range(4))
    assert_consistent(fake, vrange)
    vrange.commit(range(3))
    assert_consistent(fake, vrange)


@pytest.mark.parametrize("after", [False, True], ids=["before-the-call", "after-the-call"])
@pytest.mark.parametrize("method,nth", [("unmap", 2), ("map", 1), ("map", 3), ("set_access", 1)])
def test_interrupted_release_keeps_the_run_committed(
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeCuda,
    backend: CudaBackend,
    vrange: CudaRange,
    after: bool,
    method: str,
    nth: int,
) -> None:
    """``map`` and ``set_access`` in a release are the zero page's (zero mode only)."""
    vrange.commit(range(4))
    vrange.as_tensor()[: 4 * PAGE] = 3
    interrupt_on(monkeypatch, backend, method, nth, after=after)
    if method != "unmap" and vrange.uncommitted == "fault":
        assert vrange.release(range(4)) == 4
        monkeypatch.undo()
        return
    with pytest.raises(KeyboardInterrupt):
        vrange.release(range(4))
    monkeypatch.undo()
    assert vrange.committed_pages() == {0, 1, 2, 3}
    assert_consistent(fake, vrange)
    tensor = vrange.as_tensor()
    assert int(tensor[: 4 * PAGE].min()) == 3, "the data survives the restore"
    assert vrange.release(range(4)) == 4
    assert_consistent(fake, vrange)


@pytest.mark.parametrize("call,nth", [("cuMemUnmap", 2), ("cuMemMap", 2), ("cuMemSetAccess", 1)])
def test_driver_error_in_a_release_keeps_the_run_committed(
    fake: FakeCuda, vrange: CudaRange, call: str, nth: int
) -> None:
    vrange.commit(range(3))
    vrange.as_tensor()[: 3 * PAGE] = 5
    fake.fail(call, nth=nth)
    if call != "cuMemUnmap" and vrange.uncommitted == "fault":
        assert vrange.release(range(3)) == 3
        fake.disarm(call)
        return
    with pytest.raises(ReleaseError, match="retry the release"):
        vrange.release(range(3))
    assert vrange.committed_pages() == {0, 1, 2}
    assert_consistent(fake, vrange)
    assert int(vrange.as_tensor()[: 3 * PAGE].min()) == 5
    assert vrange.release(range(3)) == 3
    assert_consistent(fake, vrange)


# -- sticky faults --------------------------------------------------------------------------


def test_a_fault_surfaces_as_device_fault_not_commit_error(
    fake: FakeCuda, backend: CudaBackend
) -> None:
    vrange = backend.reserve(4 * PAGE)
    vrange.commit([0])
    if vrange.uncommitted == "fault":
        stray = fake.launch(vrange.base_address + PAGE, 16)  # a read of an unmapped page
    else:
        stray = fake.launch_write(vrange.base_address + PAGE, 16)  # a write to the zero page
    assert stray == CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(DeviceFault, match="context is lost") as info:
        vrange.commit([1])
    assert not isinstance(info.value, CommitError)
    with pytest.raises(DeviceFault, match="restart the process"):
        vrange.release([0])
    with pytest.raises(DeviceFault):
        vrange.close()
    # The process would have to restart; here the fake is reset instead.
    fake.reset()


def test_out_of_memory_code_is_not_a_fault(fake: FakeCuda, vrange: CudaRange) -> None:
    fake.fail("cuMemCreate", nth=1, code=CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(OutOfPhysicalMemory):
        vrange.commit([0])
    assert fake.sticky_error() == 0


# -- what each mode does with an uncommitted page -------------------------------------------


def test_fault_mode_is_strict_and_has_no_zero_page(fake: FakeCuda) -> None:
    vrange = CudaBackend(uncommitted="fault").reserve(4 * PAGE)
    assert vrange.strict and vrange.info.strict
    assert vrange.zero_page_read_only is None
    assert vrange.check_zero_page() is False
    assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 1}
    assert fake.launch(vrange.base_address, 16) == CUDA_ERROR_ILLEGAL_ADDRESS, "a read faults"
    with pytest.raises(DeviceFault):
        vrange.close()
    fake.reset()


def test_zero_mode_reads_zeros_without_a_fault(fake: FakeCuda) -> None:
    with CudaBackend().reserve(4 * PAGE) as vrange:
        assert not vrange.strict and not vrange.info.strict
        assert vrange.uncommitted == "zero" and vrange.zero_page_read_only
        assert fake.launch(vrange.base_address, 4 * PAGE) == 0, "a stray read is not a fault"
        assert int(vrange.as_tensor().max()) == 0
        assert vrange.footprint_bytes() == 0
        assert vrange.held_bytes() == vrange.zero_page_bytes() == PAGE
    assert fake.sticky_error() == 0
