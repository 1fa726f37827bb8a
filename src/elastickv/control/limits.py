"""Limits as operators write them: a size (``512M``, ``2GiB``), a share of the device budget
(``30%``), or no limit (``none``)."""

from __future__ import annotations

import re

from elastickv.units import parse_size

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_UNLIMITED = frozenset({"none", "unlimited", "off"})


def parse_limit(text: str, budget_bytes: int) -> int | None:
    """Bytes for ``text``; percentages are of ``budget_bytes`` (rounded down); None = no limit."""
    if text.strip().lower() in _UNLIMITED:
        return None
    if text.strip().startswith("-"):
        raise ValueError(
            f"invalid limit {text!r}: a limit cannot be negative; use a size (512M, 2G, 2GiB), "
            "a percentage of the device budget (30%), or 'none'"
        )
    match = _PERCENT.match(text)
    if match:
        percent = float(match.group(1))
        if percent > 100:
            raise ValueError(f"invalid limit {text!r}: a percentage must be between 0% and 100%")
        return int(budget_bytes * percent / 100)
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ValueError(
            f"invalid limit {text!r}: use a size (512M, 2G, 2GiB), a percentage of the device "
            "budget (30%), or 'none'"
        ) from exc
