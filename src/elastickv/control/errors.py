"""Ledger errors: each says what is wrong, which file, and what to do about it."""

from __future__ import annotations

RESET_COMMAND = "elastickv doctor --reset-ledger"


class LedgerError(Exception):
    """Base class of every error the control plane raises."""


class LedgerCorrupt(LedgerError):
    """The segment is not a valid ledger: truncated, foreign, or damaged."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"ledger {path} is unusable: {problem}; stop the instances using this device and run "
            f"`{RESET_COMMAND}` (or elastickv.control.Ledger.reset({path!r})) to recreate it"
        )


class LedgerVersionMismatch(LedgerError):
    """The segment was written by another format version of elastickv."""

    def __init__(self, path: str, found: int, expected: int) -> None:
        self.path = path
        self.found = found
        self.expected = expected
        super().__init__(
            f"ledger {path} has format version {found}, this elastickv speaks version {expected}; "
            "run every instance on this device with the same elastickv release, or stop them and "
            f"run `{RESET_COMMAND}` to recreate the ledger"
        )


class LedgerPermissionError(LedgerError):
    """The segment or its directory belongs to another user or is open to others."""


class LedgerConfigMismatch(LedgerError):
    """An opener asked for a device budget that differs from the one the segment holds."""


class LedgerFull(LedgerError):
    """Every record slot is taken by a live instance."""


class DuplicateInstance(LedgerError):
    """A live instance already holds the requested name."""


class UnknownInstance(LedgerError, KeyError):
    """No live instance has the given name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown instance"


class StaleRevision(LedgerError):
    """``set_limit`` was given an ``expected_revision`` that is no longer current."""

    def __init__(self, name: str, expected: int, current: int) -> None:
        self.name = name
        self.expected = expected
        self.current = current
        super().__init__(
            f"limit of instance {name!r} is at revision {current}, not {expected}: someone changed "
            "it meanwhile; re-read it (`elastickv list`, in Python list_instances()) and retry "
            "with the current revision"
        )


class LimitBelowFloor(LedgerError, ValueError):
    """``set_limit`` asked for less than the instance holds for its whole life (its floor):
    it could never get under such a limit and would stay "draining" forever."""

    def __init__(self, name: str, limit: int, floor: int) -> None:
        from elastickv.units import format_bytes, format_size

        self.name = name
        self.limit = limit
        self.floor = floor
        super().__init__(
            f"a limit of {format_bytes(limit)} is below the floor of instance {name!r}: it holds "
            f"{format_bytes(floor)} for as long as it runs (its null block's pages), so it "
            f"could never get under that limit; set at least {format_size(floor)}"
        )


class InstanceClosed(LedgerError):
    """The handle was unregistered, or its record was reclaimed or reset under it."""
