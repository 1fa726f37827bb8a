"""Byte sizes as people write them: ``4096``, ``512K``, ``2M``, ``2MiB``, ``1.5G``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse a byte size; K/M/G/T are binary (1024-based), with or without ``iB``/``B``."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(
            f"invalid size {text!r}: use a number of bytes with an optional unit, "
            "e.g. 4096, 512K, 2M, 2MiB, 1.5G"
        )
    number, unit = match.groups()
    value = float(number) * _UNITS[unit.upper()]
    if value != int(value):
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """``1310720`` → ``1280K``: exact, in the largest unit that divides it, and in
    :func:`parse_size`'s syntax, for a size a user must type (a minimum in an error message:
    :func:`format_bytes` would round 1.25 MiB down to ``1.2 MiB``, below the minimum)."""
    if n < 0:
        raise ValueError(f"a size cannot be negative, got {n}")
    for unit in ("T", "G", "M", "K"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def format_bytes(n: int | float) -> str:
    """``2097152`` → ``2.0 MiB``, for reading (rounded); exact bytes below 1 KiB. A size the
    user must type: :func:`format_size`."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds for ``250ms``, ``30s``, ``5m``, ``1h`` or a plain number of seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r}: use e.g. 250ms, 30s, 5m, 1h")
    number, unit = match.groups()
    return float(number) * _SECONDS[(unit or "s").lower()]
