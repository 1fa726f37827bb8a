"""Backend-independent pieces: page-size validation, run grouping, descriptions."""

from __future__ import annotations

import dataclasses

import pytest

from elastickv.vmm import (
    DEFAULT_PAGE_SIZE,
    HostBackend,
    PageSizeError,
    RangeInfo,
    VmmError,
    host_granularity,
    page_runs,
    round_up,
    validate_page_size,
)


@pytest.mark.parametrize(
    ("pages", "runs"),
    [
        ([], []),
        ([3], [(3, 1)]),
        ([0, 1, 2], [(0, 3)]),
        ([0, 2, 3, 7, 8, 9, 11], [(0, 1), (2, 2), (7, 3), (11, 1)]),
    ],
)
def test_page_runs_groups_consecutive_pages(pages: list[int], runs: list[tuple[int, int]]) -> None:
    assert page_runs(pages) == runs


def test_round_up() -> None:
    assert round_up(0, 4096) == 0
    assert round_up(1, 4096) == 4096
    assert round_up(4096, 4096) == 4096
    assert round_up(4097, 4096) == 8192


@pytest.mark.parametrize("page_size", [4096, 3 * 4096, DEFAULT_PAGE_SIZE, 16 << 20])
def test_valid_page_sizes(page_size: int) -> None:
    assert validate_page_size(page_size, 4096) == page_size


@pytest.mark.parametrize("page_size", [0, -4096, 1000, 4097, 2 * 4096 + 1])
def test_invalid_page_sizes_are_rejected_with_a_suggestion(page_size: int) -> None:
    with pytest.raises(PageSizeError, match="multiple of this backend's granularity") as info:
        validate_page_size(page_size, 4096)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, VmmError)
    assert str(DEFAULT_PAGE_SIZE) in str(info.value)


@pytest.mark.parametrize("page_size", [True, 2.0, "2097152"])
def test_non_int_page_sizes_are_rejected(page_size: object) -> None:
    with pytest.raises(PageSizeError, match="must be an int"):
        validate_page_size(page_size, 4096)  # type: ignore[arg-type]


def test_host_backend_validates_page_size_against_os_page_size() -> None:
    granularity = host_granularity()
    assert HostBackend().granularity == granularity
    assert HostBackend(page_size=granularity).page_size == granularity
    with pytest.raises(PageSizeError, match=str(granularity)):
        HostBackend(page_size=granularity + 512)
    with pytest.raises(PageSizeError):
        HostBackend(page_size=0)


def test_range_info_is_frozen() -> None:
    backend = HostBackend()
    with backend.reserve(3 * backend.page_size) as vrange:
        info = vrange.info
        assert info == RangeInfo(
            backend="host",
            base_address=vrange.base_address,
            size_bytes=3 * backend.page_size,
            page_size=backend.page_size,
            num_pages=3,
            strict=True,
        )
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.num_pages = 4  # type: ignore[misc]


def test_pages_for_rounds_up() -> None:
    backend = HostBackend()
    assert backend.pages_for(1) == 1
    assert backend.pages_for(backend.page_size) == 1
    assert backend.pages_for(backend.page_size + 1) == 2
