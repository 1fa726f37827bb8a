"""The shared zero page under uncommitted pages (the CUDA backend's default), through the real
cuda-bindings and the strict fake.

What must hold: a stray read of an uncommitted page sees zeros and never faults; a stray write is
reported, never silently shared: a fault where the driver grants read-only access (a SIGSEGV on
the host side of the fake, a sticky illegal address for a device kernel), found and undone by
``check_zero_page`` where it refuses that; commits and releases keep every guarantee, also when
they fail or are interrupted; the zero page is never counted as committed memory.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fakecuda_lib import (
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    FakeCuda,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pages import assert_consistent, zero_handle

import elastickv.vmm
from elastickv.vmm import CommitError, DeviceFault, ReleaseError, ReservationError
from elastickv.vmm.cuda import CudaBackend, CudaRange

MiB = 1 << 20
PAGE = 2 * MiB
HERE = Path(__file__).parent
SRC = Path(elastickv.vmm.__file__).resolve().parents[2]


@pytest.fixture
def backend() -> CudaBackend:
    return CudaBackend(page_size=PAGE, handle_pool_size=2)


@pytest.fixture
def vrange(backend: CudaBackend) -> Iterator[CudaRange]:
    with backend.reserve(8 * PAGE) as reserved:
        yield reserved


def page_bytes(vrange: CudaRange, page: int) -> Any:
    """The page's bytes through the range's tensor (a host read here: the fake's memory)."""
    return vrange.as_tensor()[page * PAGE : (page + 1) * PAGE]


def reads_zero(vrange: CudaRange, page: int) -> bool:
    return int(page_bytes(vrange, page).max()) == 0


# -- reserve --------------------------------------------------------------------------------


def test_every_uncommitted_page_maps_one_read_only_zero_page(
    fake: FakeCuda, vrange: CudaRange
) -> None:
    assert vrange.uncommitted == "zero"
    assert vrange.zero_page_read_only is True and vrange.zero_page_refusal is None
    assert_consistent(fake, vrange)
    handle = zero_handle(fake, vrange)
    assert handle is not None and fake.handle_mappings(handle) == 8 + 1
    assert fake.live() == {"handles": 1, "mappings": 9, "reservations": 1}
    assert all(reads_zero(vrange, page) for page in range(8))
    assert vrange.footprint_bytes() == vrange.committed_bytes() == 0
    assert vrange.held_bytes() == vrange.zero_page_bytes() == PAGE
    assert fake.used_bytes() == PAGE


def test_a_stray_read_kernel_never_faults(fake: FakeCuda, vrange: CudaRange) -> None:
    vrange.commit([2])
    assert fake.launch(vrange.base_address, 8 * PAGE) == 0
    assert fake.sticky_error() == 0
    vrange.release([2])
    assert fake.sticky_error() == 0, "the release waited for the queued reader"


def test_a_commit_waits_for_a_stray_reader_on_the_zero_page(
    fake: FakeCuda, vrange: CudaRange
) -> None:
    """The commit unmaps the zero page under the reader: it must finish first."""
    assert fake.launch(vrange.base_address + 3 * PAGE, PAGE) == 0
    assert fake.pending_kernels() == 1
    vrange.commit([3])
    assert fake.sticky_error() == 0
    assert fake.pending_kernels() == 0
    assert reads_zero(vrange, 3)


def test_the_zero_page_costs_one_page_per_range(fake: FakeCuda, backend: CudaBackend) -> None:
    free, total = backend.mem_get_info()
    with backend.reserve(64 * PAGE) as big, backend.reserve(PAGE) as small:
        assert free - backend.mem_get_info()[0] == 2 * PAGE
        assert big.held_bytes() == small.held_bytes() == PAGE
        assert fake.live()["mappings"] == 64 + 1 + 1 + 1
    assert backend.mem_get_info() == (free, total)


@pytest.mark.parametrize("call,nth", [("cuMemCreate", 1), ("cuMemMap", 1), ("cuMemMap", 5)])
def test_a_refused_reserve_leaves_nothing(
    fake: FakeCuda, backend: CudaBackend, call: str, nth: int
) -> None:
    fake.fail(call, nth=nth)
    with pytest.raises(ReservationError, match=rf"{call} returned.*uncommitted='fault'"):
        backend.reserve(8 * PAGE)
    assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 0}


def test_no_memory_for_the_zero_page_is_a_reservation_error(fake: FakeCuda) -> None:
    fake.fail("cuMemCreate", nth=1, code=CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(ReservationError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        CudaBackend().reserve(4 * PAGE)
    assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 0}


def test_a_lost_context_at_reserve_is_a_device_fault(fake: FakeCuda) -> None:
    fake.fail("cuMemMap", nth=2, code=CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(DeviceFault, match="restart the process"):
        CudaBackend().reserve(4 * PAGE)
    fake.reset()


@pytest.mark.parametrize(
    "method,nth,after",
    [
        # After cuMemCreate returned, an interrupt loses the new handle with Python's frame.
        ("create", 1, False),
        *(
            (method, nth, after)
            for method, nth in (("map", 1), ("map", 4), ("set_access", 2))
            for after in (False, True)
        ),
    ],
)
def test_an_interrupted_reserve_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeCuda,
    backend: CudaBackend,
    method: str,
    nth: int,
    after: bool,
) -> None:
    interrupt(monkeypatch, backend, method, nth, after=after)
    with pytest.raises(KeyboardInterrupt):
        backend.reserve(6 * PAGE)
    monkeypatch.undo()
    assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 0}


def interrupt(
    monkeypatch: pytest.MonkeyPatch, backend: CudaBackend, method: str, nth: int, *, after: bool
) -> None:
    """KeyboardInterrupt on the ``nth`` call of ``driver.<method>``, before or after it ran."""
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


# -- commit and release swap the zero page out and back in -----------------------------------


def test_commit_and_release_swap_the_zero_page(fake: FakeCuda, vrange: CudaRange) -> None:
    vrange.commit([1, 2, 5])
    assert_consistent(fake, vrange)
    tensor = vrange.as_tensor()
    tensor[PAGE : 3 * PAGE] = 7
    assert reads_zero(vrange, 0) and reads_zero(vrange, 3), "neighbours still read zeros"
    vrange.release([2])
    assert_consistent(fake, vrange)
    assert reads_zero(vrange, 2), "a released page reads the zero page again"
    assert int(tensor[PAGE : 2 * PAGE].min()) == 7
    vrange.commit([2])
    assert reads_zero(vrange, 2), "a recommitted (pooled) page is zeroed"
    assert_consistent(fake, vrange)


def test_close_unmaps_zero_runs_one_call_each(fake: FakeCuda, backend: CudaBackend) -> None:
    vrange = backend.reserve(8 * PAGE)
    vrange.commit([3])
    vrange.release([3])
    unmaps = fake.calls("cuMemUnmap")
    vrange.close()
    assert fake.calls("cuMemUnmap") == unmaps + 2  # the range's pages, then the window


def test_close_unmaps_page_by_page_when_a_run_is_refused(
    fake: FakeCuda, backend: CudaBackend
) -> None:
    vrange = backend.reserve(4 * PAGE)
    unmaps = fake.calls("cuMemUnmap")
    fake.fail("cuMemUnmap", nth=1)
    vrange.close()
    assert fake.calls("cuMemUnmap") == unmaps + 1 + 4 + 1


def test_closing_with_committed_pages_maps_no_zero_page_over_them(
    fake: FakeCuda, backend: CudaBackend
) -> None:
    vrange = backend.reserve(4 * PAGE)
    vrange.commit(range(4))
    maps = fake.calls("cuMemMap")
    vrange.close()
    assert fake.calls("cuMemMap") == maps


@pytest.mark.parametrize(
    "first,then",
    [(("cuMemSetAccess", 1), ("cuMemMap", 3)), (("cuMemMap", 2), ("cuMemSetAccess", 1))],
    ids=["zero-map-refused", "zero-access-refused"],
)
def test_a_failed_rollback_remap_is_reported_and_heals(
    fake: FakeCuda, vrange: CudaRange, first: tuple[str, int], then: tuple[str, int]
) -> None:
    """A commit fails, then its rollback's zero-page map (or access) fails too: the page is left
    unmapped (or without access: a stray access there would fault), the error says so, and the
    next commit of those pages and the close still work."""
    fake.fail(*first)
    fake.fail(*then)
    with pytest.raises(CommitError) as info:
        vrange.commit([4, 5])
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "zero page" in notes
    assert vrange.committed_pages() == frozenset()
    vrange.commit([4, 5])
    assert_consistent(fake, vrange)
    vrange.release([4, 5])
    assert_consistent(fake, vrange)


# -- stray writes ----------------------------------------------------------------------------


def run_child(body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter with the fake driver loaded and host tensors."""
    prelude = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from fakecuda_lib import load
fake = load()
from elastickv.vmm import cuda_dlpack
cuda_dlpack.KDL_CUDA = cuda_dlpack.KDL_CPU
from elastickv.vmm.cuda import CudaBackend
PAGE = {PAGE}
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_stray_write_to_a_read_only_zero_page_faults() -> None:
    result = run_child(
        """
        vrange = CudaBackend().reserve(4 * PAGE)
        assert vrange.zero_page_read_only
        vrange.commit([0])
        tensor = vrange.as_tensor()
        tensor[:PAGE] = 3
        assert int(tensor[PAGE:].max()) == 0
        print("READS-OK", flush=True)
        tensor[2 * PAGE + 100] = 1
        print("NOT-REACHED", flush=True)
        """
    )
    assert "READS-OK" in result.stdout, result.stderr
    assert "NOT-REACHED" not in result.stdout
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr)


def test_the_child_runs_clean_without_a_stray_write() -> None:
    result = run_child(
        """
        with CudaBackend().reserve(4 * PAGE) as vrange:
            vrange.commit([0])
            vrange.as_tensor()[:PAGE] = 3
        assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 0}
        print("DONE", flush=True)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "DONE" in result.stdout


def test_a_stray_device_write_is_a_device_fault(fake: FakeCuda, vrange: CudaRange) -> None:
    vrange.commit([0])
    assert fake.launch_write(vrange.base_address + 4 * PAGE, 64) == CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(DeviceFault, match="wrote to an uncommitted page"):
        vrange.commit([1])
    with pytest.raises(DeviceFault):
        vrange.close()
    fake.reset()


def test_check_is_a_copy_that_finds_nothing_when_read_only(
    fake: FakeCuda, vrange: CudaRange
) -> None:
    copies = fake.calls("cuMemcpyDtoH")
    assert vrange.check_zero_page() is False
    assert fake.calls("cuMemcpyDtoH") == copies + 1
    assert vrange.zero_page_writes == 0


@pytest.mark.parametrize("code", [CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_INVALID_VALUE])
def test_read_write_fallback_reports_and_undoes_a_stray_write(fake: FakeCuda, code: int) -> None:
    """Where the driver refuses read-only access the zero page is read-write: a stray write goes
    through and is visible through every uncommitted page until ``check_zero_page`` finds it and
    zeroes the page again. It never reaches a committed page."""
    fake.refuse_read_only(code)
    with CudaBackend().reserve(6 * PAGE) as vrange:
        assert vrange.zero_page_read_only is False
        assert vrange.zero_page_refusal is not None
        assert "cuMemSetAccess" in vrange.zero_page_refusal
        assert_consistent(fake, vrange)
        vrange.commit([0])
        assert vrange.check_zero_page() is False
        tensor = vrange.as_tensor()
        tensor[2 * PAGE + 10] = 9  # a stray write (a host store stands for a kernel's)
        assert int(tensor[4 * PAGE + 10]) == 9, "the fallback only detects: the alias shows it"
        assert int(tensor[:PAGE].max()) == 0
        assert vrange.check_zero_page() is True
        assert vrange.zero_page_writes == 1
        assert all(reads_zero(vrange, page) for page in range(1, 6))
        assert vrange.check_zero_page() is False
        assert fake.launch_write(vrange.base_address + 5 * PAGE, 32) == 0  # a device store
        assert vrange.check_zero_page() is True
        assert vrange.zero_page_writes == 2
        assert_consistent(fake, vrange)
    assert fake.sticky_error() == 0


def test_a_read_only_refusal_is_not_taken_for_a_lost_context(fake: FakeCuda) -> None:
    fake.refuse_read_only(CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(DeviceFault):
        CudaBackend().reserve(2 * PAGE)
    fake.reset()


def test_check_after_close_is_refused(fake: FakeCuda, backend: CudaBackend) -> None:
    vrange = backend.reserve(2 * PAGE)
    vrange.close()
    with pytest.raises(elastickv.vmm.RangeClosedError):
        vrange.check_zero_page()


# -- random sequences ------------------------------------------------------------------------

PAGES = 6
FAILING_CALLS = ("cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemsetD8Async", "cuMemCreate")
operations = st.lists(
    st.tuples(
        st.sampled_from(["commit", "release", "stray-read"]),
        st.frozensets(st.integers(0, PAGES - 1), min_size=1, max_size=PAGES),
        st.none() | st.tuples(st.sampled_from(FAILING_CALLS), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=operations, read_only=st.booleans())
def test_random_commits_and_releases_keep_the_invariants(
    fake: FakeCuda, steps: list[tuple[str, frozenset[int], tuple[str, int] | None]], read_only: bool
) -> None:
    """Any sequence of commits, releases and stray reads, some with a driver call failing midway:
    every uncommitted page reads zeros, committed pages keep their data, nothing faults, the
    footprint is the committed pages, the driver's mappings are what the mode says."""
    fake.refuse_read_only(0 if read_only else CUDA_ERROR_NOT_SUPPORTED)
    data: dict[int, int] = {}
    with CudaBackend(page_size=PAGE, handle_pool_size=2).reserve(PAGES * PAGE) as vrange:
        tensor = vrange.as_tensor()
        for action, pages, failure in steps:
            if failure is not None and action != "stray-read":
                fake.fail(*failure)
            try:
                if action == "commit":
                    vrange.commit(pages)
                elif action == "release":
                    vrange.release(pages)
                else:
                    assert fake.launch(vrange.base_address, PAGES * PAGE) == 0
            except (CommitError, ReleaseError):
                pass
            finally:
                if failure is not None:
                    fake.disarm(failure[0])
            committed = vrange.committed_pages()
            for page in set(data) - committed:
                del data[page]
            for page in sorted(committed - set(data)):
                data[page] = 1 + len(data) % 250
                tensor[page * PAGE : (page + 1) * PAGE] = data[page]
            for page in range(PAGES):
                chunk = tensor[page * PAGE : (page + 1) * PAGE]
                expected = data.get(page, 0)
                assert int(chunk.min()) == int(chunk.max()) == expected, (page, expected)
            assert vrange.footprint_bytes() == len(committed) * PAGE
            assert_consistent(fake, vrange)
            assert fake.sticky_error() == 0
        del tensor, chunk
    gc.collect()
    fake.refuse_read_only(0)
    assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 0}
