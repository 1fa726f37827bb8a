"""Real processes sharing one host ledger: the budget holds under contention (by the ledger's
own books and by the kernel's footprints), and a killed instance's memory comes back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastickv.control import LedgerPolicy, open_ledger
from elastickv.vmm import HostBackend

WORKER = str(Path(__file__).with_name("ledger_worker.py"))
MiB = 1 << 20


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_line(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"worker died before registering: {proc.stderr.read() if proc.stderr else ''}"
    message: dict[str, object] = json.loads(line)
    return message


def kernel_footprint(pid: int, fd: int) -> int:
    """What the kernel holds for a worker's memfd pool, read through /proc."""
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
    except FileNotFoundError:
        return 0


# The workers run until the test has seen what it waits for (contention, a refusal, credit
# held: the state each test is about, reached by construction rather than by running long
# enough), and for at least MIN_OPS operations each. Only against a hang: HANG_S.
MIN_OPS = 200
MIN_SAMPLES = 100
HANG_S = 120.0


def start_together(workers: list[subprocess.Popen[str]]) -> dict[str, tuple[int, int]]:
    """Each worker's pool (pid, memfd) once every one registered; then ``go`` to all."""
    pools = {}
    for proc in workers:
        ready = first_line(proc)
        pools[str(ready["ready"])] = (proc.pid, int(str(ready["fd"])))
    tell(workers, "go")
    return pools


def tell(workers: list[subprocess.Popen[str]], line: str) -> None:
    for proc in workers:
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()


def summaries(workers: list[subprocess.Popen[str]]) -> list[dict[str, object]]:
    found = []
    for proc in workers:
        out, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 0, out + err
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def test_contending_processes_never_exceed_the_budget(tmp_path: Path) -> None:
    budget = 12 * MiB  # three workers want up to 8 MiB each
    ledger = open_ledger(directory=str(tmp_path), total_bytes=budget, utilization=1.0)
    workers = [spawn("stress", str(tmp_path), f"w{i}", str(MIN_OPS), str(i)) for i in range(3)]
    try:
        pools = start_together(workers)
        samples = 0
        peak = 0
        refused = 0
        stopped = False
        deadline = time.monotonic() + HANG_S
        while any(proc.poll() is None for proc in workers):
            with ledger.frozen() as snap:
                used = snap.usage.used_bytes
                assert used <= budget
                committed = {info.name: info.committed_bytes for info in snap.instances}
                refused = max(refused, sum(info.refusals for info in snap.instances))
                footprints = {name: kernel_footprint(pid, fd) for name, (pid, fd) in pools.items()}
            for name, footprint in footprints.items():
                assert footprint <= committed.get(name, 0), (name, footprint, committed)
            assert sum(footprints.values()) <= budget
            peak = max(peak, used)
            samples += 1
            if not stopped and samples >= MIN_SAMPLES and peak > budget // 2 and refused:
                tell(workers, "stop")  # they contended, and the budget refused some
                stopped = True
            assert stopped or time.monotonic() < deadline, (samples, peak, refused)
            time.sleep(0.005)
        done = summaries(workers)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert stopped, "the workers ended before the test saw them contend"
    assert sum(int(str(s["refusals"])) for s in done) > 0, "the budget never refused anything"
    for summary in done:
        # Every refusal was a clean "not now" counted by the allocator, not an exception.
        assert summary["allocator_refusals"] == summary["refusals"]
        assert int(str(summary["ops"])) >= MIN_OPS
    assert ledger.device_usage().used_bytes == 0
    assert ledger.list_instances() == []
    ledger.close()


def test_engines_on_credit_never_hold_more_than_the_budget(tmp_path: Path) -> None:
    """Three engines' protocol at once (credit per step, blocks within it, pages granted and
    mapped by a follower): committed plus credit of all of them never exceeds the budget at
    any sample, and no kernel footprint exceeds what its engine holds in the ledger."""
    budget = 12 * MiB
    ledger = open_ledger(directory=str(tmp_path), total_bytes=budget, utilization=1.0)
    workers = [spawn("credit", str(tmp_path), f"c{i}", str(MIN_OPS), str(i)) for i in range(3)]
    try:
        pools = start_together(workers)
        samples = 0
        peak_credit = 0
        refused = 0
        stopped = False
        deadline = time.monotonic() + HANG_S
        while any(proc.poll() is None for proc in workers):
            with ledger.frozen() as snap:
                held = {i.name: i.committed_bytes + i.reserved_bytes for i in snap.instances}
                credit = sum(i.reserved_bytes for i in snap.instances)
                refused = max(refused, sum(i.refusals for i in snap.instances))
                footprints = {name: kernel_footprint(pid, fd) for name, (pid, fd) in pools.items()}
            assert sum(held.values()) <= budget, held
            for name, footprint in footprints.items():
                assert footprint <= held.get(name, 0), (name, footprint, held)
            peak_credit = max(peak_credit, credit)
            samples += 1
            if not stopped and samples >= MIN_SAMPLES and peak_credit and refused:
                tell(workers, "stop")  # credit was held, and the budget refused some
                stopped = True
            assert stopped or time.monotonic() < deadline, (samples, peak_credit, refused)
            time.sleep(0.005)
        done = summaries(workers)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert stopped, "the workers ended before the test saw credit held and refused"
    assert all(int(str(s["ops"])) >= MIN_OPS for s in done), done
    assert ledger.device_usage().used_bytes == 0
    ledger.close()


def test_a_killed_instance_memory_is_taken_by_the_next_request(tmp_path: Path) -> None:
    """docs/control.md: a dead record's bytes are available to the very next request; a
    zombie counts as dead, so no waiting is involved once the process is gone."""
    budget = 8 * MiB
    with open_ledger(directory=str(tmp_path), total_bytes=budget, utilization=1.0) as ledger:
        victim = spawn("hold", str(tmp_path), "victim", str(6 * MiB))
        try:
            ready = first_line(victim)
            held = int(str(ready["committed"]))
            assert held >= 6 * MiB
            assert [i.name for i in ledger.list_instances()] == ["victim"]
            with (
                ledger.register("survivor") as handle,
                HostBackend(page_size=64 * 1024).reserve(8 * MiB) as vrange,
            ):
                policy = LedgerPolicy(handle)
                want = 6 * MiB
                assert not policy.try_admit(want)
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
                assert policy.try_admit(want), "dead instance's memory not reclaimed"
                vrange.commit(range(want // vrange.page_size))
                assert vrange.footprint_bytes() == want
                names = [i.name for i in ledger.list_instances()]
                assert names == ["survivor"]
                assert ledger.device_usage().reclaimed >= 1
                vrange.release(range(want // vrange.page_size))
                policy.release(want)
        finally:
            victim.kill()
            victim.wait()
