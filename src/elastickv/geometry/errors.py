"""The one error type the geometry core raises."""

from __future__ import annotations

from collections.abc import Iterable


class GeometryError(ValueError):
    """An unsupported or inconsistent KV-cache geometry.

    Raised before any memory is touched. ``field`` names the offending input and
    ``accepted`` (when there is a finite set) lists what would have worked, so the
    message tells the user what to change.
    """

    def __init__(self, field: str, problem: str, accepted: Iterable[object] | None = None) -> None:
        self.field = field
        self.problem = problem
        self.accepted = tuple(accepted) if accepted is not None else None
        message = f"{field}: {problem}"
        if self.accepted is not None:
            message += f" (accepted: {', '.join(str(a) for a in self.accepted)})"
        super().__init__(message)
