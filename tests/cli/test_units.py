from __future__ import annotations

import pytest

from elastickv.units import format_bytes, parse_size


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
