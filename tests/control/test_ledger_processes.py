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


def test_contending_processes_never_exceed_the_budget(tmp_path: Path) -> None:
    budget = 12 * MiB  # three workers want up to 8 MiB each
    ledger = open_ledger(directory=str(tmp_path), total_bytes=budget, utilization=1.0)
    workers = [spawn("stress", str(tmp_path), f"w{i}", "10", str(i)) for i in range(3)]
    try:
        pools = {}
        for proc in workers:
            ready = first_line(proc)
            pools[str(ready["ready"])] = (proc.pid, int(str(ready["fd"])))
        for proc in workers:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        samples = 0
        peak = 0
        while any(proc.poll() is None for proc in workers):
            with ledger.frozen() as snap:
                used = snap.usage.used_bytes
                assert used <= budget
                committed = {info.name: info.committed_bytes for info in snap.instances}
                footprints = {name: kernel_footprint(pid, fd) for name, (pid, fd) in pools.items()}
            for name, footprint in footprints.items():
                assert footprint <= committed.get(name, 0), (name, footprint, committed)
            assert sum(footprints.values()) <= budget
            peak = max(peak, used)
            samples += 1
            time.sleep(0.005)
        summaries = []
        for proc in workers:
            out, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
            summaries.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert samples > 100
    assert peak > budget // 2, "the workers never contended"
    refusals = sum(int(s["refusals"]) for s in summaries)
    assert refusals > 0, "the budget never refused anything"
    for summary in summaries:
        # Every refusal was a clean "not now" counted by the allocator, not an exception.
        assert summary["allocator_refusals"] == summary["refusals"]
        assert int(summary["ops"]) > 100
    assert ledger.device_usage().used_bytes == 0
    assert ledger.list_instances() == []
    ledger.close()


def test_engines_on_credit_never_hold_more_than_the_budget(tmp_path: Path) -> None:
    """Three engines' protocol at once (credit per step, blocks within it, pages granted and
    mapped by a follower): committed plus credit of all of them never exceeds the budget at
    any sample, and no kernel footprint exceeds what its engine holds in the ledger."""
    budget = 12 * MiB
    ledger = open_ledger(directory=str(tmp_path), total_bytes=budget, utilization=1.0)
    workers = [spawn("credit", str(tmp_path), f"c{i}", "6", str(i)) for i in range(3)]
    try:
        pools = {}
        for proc in workers:
            ready = first_line(proc)
            pools[str(ready["ready"])] = (proc.pid, int(str(ready["fd"])))
        for proc in workers:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        samples = 0
        peak_credit = 0
        while any(proc.poll() is None for proc in workers):
            with ledger.frozen() as snap:
                held = {i.name: i.committed_bytes + i.reserved_bytes for i in snap.instances}
                credit = sum(i.reserved_bytes for i in snap.instances)
                footprints = {name: kernel_footprint(pid, fd) for name, (pid, fd) in pools.items()}
            assert sum(held.values()) <= budget, held
            for name, footprint in footprints.items():
                assert footprint <= held.get(name, 0), (name, footprint, held)
            peak_credit = max(peak_credit, credit)
            samples += 1
            time.sleep(0.005)
        summaries = []
        for proc in workers:
            out, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, out + err
            summaries.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert samples > 50
    assert peak_credit > 0, "no engine ever held credit"
    assert sum(int(s["refusals"]) for s in summaries) > 0, "the budget never bound"
    assert ledger.device_usage().used_bytes == 0
    ledger.close()


def test_killed_instance_memory_is_taken_within_a_second(tmp_path: Path) -> None:
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
                start = time.monotonic()
                while not policy.try_admit(want):
                    assert time.monotonic() - start < 1.0, "dead instance's memory not reclaimed"
                    time.sleep(0.01)
                elapsed = time.monotonic() - start
                vrange.commit(range(want // vrange.page_size))
                assert vrange.footprint_bytes() == want
                names = [i.name for i in ledger.list_instances()]
                assert names == ["survivor"]
                assert ledger.device_usage().reclaimed >= 1
                vrange.release(range(want // vrange.page_size))
                policy.release(want)
            assert elapsed < 1.0
        finally:
            victim.kill()
            victim.wait()
