"""Per-page commit/release latency of the host VMM backend vs the raw libc calls, in one run.

The raw side does exactly the system calls the backend makes (``fallocate`` + ``mmap`` to commit,
``mmap(PROT_NONE)`` + ``fallocate(PUNCH_HOLE)`` to release) through its own ctypes bindings, on
its own reservation and memfd, so the ratio is the cost of the backend's bookkeeping.
Released pages have been written first, as a KV cache's pages would be. Backend and raw calls
are measured in adjacent pairs; ``ratio`` is the median of the per-pair ratios, which cancels
drift from other load on the machine.

    python benchmarks/bench_vmm.py            # rich table
    python benchmarks/bench_vmm.py --json     # machine-readable
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

from elastickv.vmm import DEFAULT_PAGE_SIZE, HostBackend
from elastickv.vmm.host import (
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_FIXED,
    MAP_PRIVATE,
    MAP_SHARED,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
)


@dataclass(frozen=True)
class Result:
    """One operation: median latency per page on both sides, median paired ratio and the median
    paired difference per call (the backend's own overhead)."""

    operation: str
    pages_per_call: int
    backend_us_per_page: float
    raw_us_per_page: float
    ratio: float
    overhead_us_per_call: float


class RawPool:
    """The same memory layout as the backend, driven by bare libc calls."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.fallocate = libc.fallocate
        self.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        self.page_size = page_size
        self.size = num_pages * page_size
        self.fd = os.memfd_create("bench-raw", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        base = self.mmap(None, self.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if base == MAP_FAILED:
            raise OSError(ctypes.get_errno(), "raw reservation failed")
        self.base = int(base)

    def commit(self, first: int, count: int) -> None:
        offset, length = first * self.page_size, count * self.page_size
        if self.fallocate(self.fd, 0, offset, length) != 0:
            raise OSError(ctypes.get_errno(), "fallocate")
        flags = MAP_SHARED | MAP_FIXED
        prot = PROT_READ | PROT_WRITE
        if self.mmap(self.base + offset, length, prot, flags, self.fd, offset) == MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap")

    def release(self, first: int, count: int) -> None:
        offset, length = first * self.page_size, count * self.page_size
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED
        if self.mmap(self.base + offset, length, PROT_NONE, flags, -1, 0) == MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap")
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if self.fallocate(self.fd, mode, offset, length) != 0:
            raise OSError(ctypes.get_errno(), "fallocate")

    def close(self) -> None:
        self.munmap(self.base, self.size)
        os.close(self.fd)


def timed(call: Callable[[], object], pages: int) -> float:
    """Microseconds per page of one call."""
    start = time.perf_counter_ns()
    call()
    return (time.perf_counter_ns() - start) / 1000 / pages


def measure(page_size: int, num_pages: int, repeats: int, batch: int) -> list[Result]:
    """Backend and raw calls alternate call by call (who goes first alternates too), so drift
    in the machine's state hits both sides alike."""
    backend = HostBackend(page_size=page_size)
    samples: dict[str, list[float]] = {k: [] for k in ("bc", "br", "rc", "rr")}
    starts = range(0, num_pages - batch + 1, batch)
    with backend.reserve(num_pages * page_size) as vrange:
        raw = RawPool(num_pages, page_size)
        try:
            for repeat in range(repeats):
                for phase, op in (("c", "commit"), ("r", "release")):
                    if phase == "r":
                        ctypes.memset(vrange.base_address, 1, num_pages * page_size)
                        ctypes.memset(raw.base, 1, num_pages * page_size)
                    for i, first in enumerate(starts):
                        pages = range(first, first + batch)
                        ours = partial(getattr(vrange, op), pages)
                        theirs = partial(getattr(raw, op), first, batch)
                        pair = [("b", ours), ("r", theirs)]
                        if (i + repeat) % 2:
                            pair.reverse()
                        for side, call in pair:
                            samples[side + phase].append(timed(call, batch))
            assert vrange.footprint_bytes() == 0
            assert os.fstat(raw.fd).st_blocks == 0
        finally:
            raw.close()
    return [
        result("commit", batch, samples["bc"], samples["rc"]),
        result("release", batch, samples["br"], samples["rr"]),
    ]


def result(operation: str, batch: int, backend: list[float], raw: list[float]) -> Result:
    backend_us = statistics.median(backend)
    raw_us = statistics.median(raw)
    ratio = statistics.median(b / r for b, r in zip(backend, raw, strict=True))
    return Result(
        operation=operation,
        pages_per_call=batch,
        backend_us_per_page=round(backend_us, 2),
        raw_us_per_page=round(raw_us, 2),
        ratio=round(ratio, 3),
        overhead_us_per_call=round(
            statistics.median(b - r for b, r in zip(backend, raw, strict=True)) * batch, 2
        ),
    )


def print_table(results: list[Result], header: dict[str, object]) -> None:
    from rich.table import Table

    from elastickv.cli.tables import output_console, print_table

    title = ", ".join(f"{k}={v}" for k, v in header.items())
    table = Table(title=f"host VMM backend vs raw libc ({title})")
    columns = ("operation", "pages/call", "backend µs/page", "raw µs/page", "ratio", "Δ µs/call")
    for column in columns:
        table.add_column(column, justify="right" if column != "operation" else "left")
    for r in results:
        table.add_row(
            r.operation,
            str(r.pages_per_call),
            f"{r.backend_us_per_page:.2f}",
            f"{r.raw_us_per_page:.2f}",
            f"{r.ratio:.3f}",
            f"{r.overhead_us_per_call:+.2f}",
        )
    print_table(output_console(), table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument("--pages", type=int, default=64, help="pages per repeat and side")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    results: list[Result] = []
    for batch in (1, 8):
        results += measure(args.page_size, args.pages, args.repeats, batch)
    header: dict[str, object] = {
        "page_size": args.page_size,
        "pages": args.pages,
        "repeats": args.repeats,
        "wall_s": round(time.perf_counter() - started, 2),
    }
    if args.json:
        print(json.dumps({**header, "results": [asdict(r) for r in results]}, indent=2))
    else:
        print_table(results, header)


if __name__ == "__main__":
    main()
