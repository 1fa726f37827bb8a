"""Liveness and colocated start-up: dead or impostor records are reclaimed by the next
operation; instances starting together on a fresh device all register (kvcached #193)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ledger_cases import BUDGET, MiB

from elastickv.control import Ledger, open_ledger
from elastickv.control.liveness import current_identity, process_start_time
from elastickv.control.records import F_COMMITTED, read_raw, record_offset, write_raw

START_AND_REGISTER = """
import sys
from elastickv.control import open_ledger
print("ready", flush=True)
sys.stdin.readline()  # every child imported and waiting: all open the ledger at once
ledger = open_ledger(directory=sys.argv[1], total_bytes={budget})
handle = ledger.register()
assert handle.try_admit({nbytes})
print(handle.name, flush=True)
{ending}
"""


def run_children(directory: Path, count: int, *, ending: str) -> list[str]:
    """``count`` children open a fresh ledger and register together: each waits, imports
    done, until all are waiting (a line on a pipe; no busy wait for a clock time)."""
    code = START_AND_REGISTER.format(budget=BUDGET, nbytes=MiB, ending=ending)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    names = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        names.append(out.strip())
    return names


def test_simultaneous_start_on_a_fresh_device(ledger_dir: Path) -> None:
    # The children exit without unregistering: their records die with them.
    names = run_children(ledger_dir, 4, ending="import os; os._exit(0)")
    assert len(set(names)) == 4
    with open_ledger() as ledger:
        usage = ledger.device_usage()
        assert usage.instances == 0 and usage.used_bytes == 0
        assert usage.reclaimed == 4
        assert usage.budget_bytes == int(BUDGET * 0.9)


def test_pid_reuse_is_not_mistaken_for_the_owner(ledger: Ledger) -> None:
    ghost = ledger.register("ghost")
    assert ghost.try_admit(8 * MiB)
    offset = record_offset(ghost.slot)
    raw: list[object] = list(read_raw(ledger._segment.mm, offset))
    start = raw[3]
    assert isinstance(start, int)
    raw[3] = start + 1  # same pid, another start time: a different process
    write_raw(ledger._segment.mm, offset, raw)
    with open_ledger() as other:
        assert other.list_instances() == []
        assert other.device_usage().available_bytes == BUDGET
    assert raw[F_COMMITTED] == 8 * MiB


def test_start_time_identifies_this_process() -> None:
    me = current_identity()
    assert me.pid == os.getpid()
    assert process_start_time(os.getpid()) == me.start_time
    assert process_start_time(0) is None
    assert process_start_time(2**22 + 7) is None
