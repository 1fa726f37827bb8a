"""Cost of admitting physical growth through the cross-process ledger.

1. Admission: ``try_admit`` + ``release`` through the ledger vs the same pair on a local
   ``FixedBudget`` (no ledger), in alternating rounds; ``ratio`` = ledger / local (> 1: slower).
2. Commit: a real 2 MiB host page commit + release with each admission in front, so the
   ledger's cost is seen against the system calls it guards; ``ratio`` = with / without.
3. Contention: 1, 2 and 4 processes hammering one ledger (budget never binding): total
   admit+release pairs per second, i.e. how the single mutation lock scales.

    python benchmarks/bench_ledger.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from elastickv.alloc import CapacityPolicy, FixedBudget
from elastickv.control import LedgerPolicy, open_ledger
from elastickv.vmm import HostBackend

GiB = 1 << 30
PAIR_BYTES = 64 * 1024


@dataclass(frozen=True)
class AdmissionResult:
    ledger_us_per_pair: float
    local_us_per_pair: float
    ratio: float


@dataclass(frozen=True)
class CommitResult:
    page_size: int
    with_ledger_us: float
    without_ledger_us: float
    ratio: float


@dataclass(frozen=True)
class ContentionResult:
    processes: int
    pairs_per_s: float
    per_process_pairs_per_s: float


def time_pairs(policy: CapacityPolicy, n: int) -> float:
    admit, release = policy.try_admit, policy.release
    start = time.perf_counter()
    for _ in range(n):
        admit(PAIR_BYTES)
        release(PAIR_BYTES)
    return (time.perf_counter() - start) / n * 1e6


def bench_admission(directory: str, rounds: int, n: int) -> AdmissionResult:
    with open_ledger(directory=directory) as ledger, ledger.register("bench-admit") as handle:
        ours = LedgerPolicy(handle)
        local = FixedBudget(GiB)
        time_pairs(ours, n // 10)
        ledger_us, local_us = [], []
        for _ in range(rounds):
            ledger_us.append(time_pairs(ours, n))
            local_us.append(time_pairs(local, n))
    a, b = statistics.median(ledger_us), statistics.median(local_us)
    return AdmissionResult(round(a, 3), round(b, 3), round(a / b, 2))


def time_commits(policy: CapacityPolicy, n: int) -> float:
    with HostBackend().reserve(HostBackend().page_size) as vrange:
        size = vrange.page_size
        start = time.perf_counter()
        for _ in range(n):
            assert policy.try_admit(size)
            vrange.commit([0])
            vrange.release([0])
            policy.release(size)
        return (time.perf_counter() - start) / n * 1e6


def bench_commit(directory: str, rounds: int, n: int) -> CommitResult:
    with open_ledger(directory=directory) as ledger, ledger.register("bench-commit") as handle:
        ours = LedgerPolicy(handle)
        local = FixedBudget(GiB)
        with_ledger, without = [], []
        for _ in range(rounds):
            with_ledger.append(time_commits(ours, n))
            without.append(time_commits(local, n))
    a, b = statistics.median(with_ledger), statistics.median(without)
    return CommitResult(HostBackend().page_size, round(a, 1), round(b, 1), round(a / b, 3))


def worker(directory: str, name: str, start_at: float, seconds: float) -> None:
    """One contending process: admit+release pairs from ``start_at`` for ``seconds``."""
    with open_ledger(directory=directory) as ledger, ledger.register(name) as handle:
        admit, release = handle.try_admit, handle.release
        while time.time() < start_at:
            time.sleep(0.001)
        deadline = time.perf_counter() + seconds
        pairs = 0
        while time.perf_counter() < deadline:
            for _ in range(100):
                admit(PAIR_BYTES)
                release(PAIR_BYTES)
            pairs += 100
    print(json.dumps({"pairs": pairs, "seconds": seconds}), flush=True)


def bench_contention(directory: str, processes: int, seconds: float) -> ContentionResult:
    start_at = time.time() + 1.0
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                directory,
                f"c{processes}-{i}",
                str(start_at),
                str(seconds),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    total = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"contention worker failed with status {proc.returncode}")
        total += json.loads(out)["pairs"]
    rate = total / seconds
    return ContentionResult(processes, round(rate), round(rate / processes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--worker", nargs=4, metavar=("DIR", "NAME", "START", "SECONDS"))
    args = parser.parse_args(argv)
    if args.worker:
        directory, name, start_at, seconds = args.worker
        worker(directory, name, float(start_at), float(seconds))
        return 0
    rounds, n, seconds = (3, 2000, 0.5) if args.quick else (7, 10000, 2.0)
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as directory:
        admission = bench_admission(directory, rounds, n)
        commit = bench_commit(directory, rounds, n // 50)
        contention = [bench_contention(directory, k, seconds) for k in (1, 2, 4)]
    result = {
        "admission": asdict(admission),
        "commit": asdict(commit),
        "contention": [asdict(c) for c in contention],
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"admission: ledger {admission.ledger_us_per_pair} us/pair, local "
        f"{admission.local_us_per_pair} us/pair, ratio {admission.ratio}x"
    )
    print(
        f"commit {commit.page_size >> 20} MiB page: with ledger {commit.with_ledger_us} us, "
        f"without {commit.without_ledger_us} us, ratio {commit.ratio}"
    )
    for c in contention:
        print(
            f"{c.processes} process(es): {c.pairs_per_s} pairs/s in all, "
            f"{c.per_process_pairs_per_s} per process"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
