"""Is the process that registered a record still the same, running process?

A pid alone is not an identity: after a crash the kernel may hand the pid to an unrelated
process. The pair (pid, start time in clock ticks since boot, field 22 of /proc/<pid>/stat)
is, for the lifetime of the machine. A zombie (exited, not yet reaped) counts as dead: its
memory is already gone. Processes must share a pid namespace with the ledger's other users.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_DEAD_STATES = frozenset("ZXx")


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int


def process_start_time(pid: int, proc_root: str = "/proc") -> int | None:
    """Start time of a running ``pid``, or None if it does not exist or has exited."""
    if pid <= 0:
        return None
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as stat_file:
            data = stat_file.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0].decode(errors="replace") in _DEAD_STATES:
        return None
    return int(fields[19])


def current_identity() -> ProcessIdentity:
    pid = os.getpid()
    start = process_start_time(pid)
    if start is None:
        raise RuntimeError("cannot read this process's start time from /proc; is /proc mounted?")
    return ProcessIdentity(pid, start)


def is_alive(identity: ProcessIdentity) -> bool:
    """True if ``identity.pid`` runs and is the process that started at ``start_time``."""
    return process_start_time(identity.pid) == identity.start_time
