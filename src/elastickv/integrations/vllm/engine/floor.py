"""The sentence an engine's start-up refusal states its minimum in, and how a supervisor
(``elastickv serve``, which sets the engine's budget from its own ``min_kv``) reads the
minimum back from the engine's log to name its own setting. Torch-free."""

from __future__ import annotations

import re

from elastickv.units import format_size, parse_size

_NEEDS = re.compile(r"this engine needs at least (\d+[KMGT]?) to start")


def needs_at_least(floor: int) -> str:
    """The refusal's statement of the minimum, exact and in a size the user can type."""
    return f"this engine needs at least {format_size(floor)} to start"


def stated_floor(log: str) -> int | None:
    """The minimum the last refusal in ``log`` stated (None: no refusal there)."""
    found = _NEEDS.findall(log)
    return parse_size(found[-1]) if found else None
