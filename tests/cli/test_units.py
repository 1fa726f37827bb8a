from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastickv.units import format_bytes, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("512K", 512 << 10),
        ("2M", 2 << 20),
        ("2MiB", 2 << 20),
        ("2mb", 2 << 20),
        ("1.5G", 3 << 29),
        ("2GiB", 2 << 30),
        (" 1T ", 1 << 40),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "M", "-1", "2Q", "1.5", "0.3K"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(2 << 20) == "2.0 MiB"


@given(st.integers(0, 1 << 50))
def test_format_size_is_exact_and_typable(value: int) -> None:
    assert parse_size(format_size(value)) == value


def test_format_size_keeps_what_format_bytes_rounds() -> None:
    """A floor of 20 pages of 64 KiB: ``format_bytes`` says 1.2 MiB (below it, and not a
    size ``parse_size`` takes); the exact form is 1280K."""
    floor = 20 * (64 << 10)
    assert format_bytes(floor) == "1.2 MiB"
    assert format_size(floor) == "1280K"
    assert (format_size(2 << 20), format_size(1000), format_size(0)) == ("2M", "1000", "0")
    with pytest.raises(ValueError, match="negative"):
        format_size(-1)
