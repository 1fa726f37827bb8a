"""The commit protocol's cost: the scheduler grants pages, each worker maps them.

What a step pays for the pages it commits or releases, by part, each against the direct call
on the same backend in the same run (``docs/performance.md#granting-pages``):

* **worker**: :meth:`GrantFollower.apply` of one batch on a host range (order check, held
  releases, runs) vs ``range.commit``/``range.release`` of the same pages, contiguous and
  scattered (every other page). µs per page; a rank pays it on its own range, in parallel
  with the other ranks.
* **scheduler**: recording the batch in :class:`PageGrants` and draining it (what the
  allocator and ``end_step`` add to a step), µs per step, independent of the ranks.
* **transport**: the batch's pickled bytes and pickle + unpickle time; it rides in the
  ``SchedulerOutput`` vLLM sends every worker anyway, so no message is added.
* **ranks**: a batch sent to R worker processes over pipes, each mapping its own memfd
  range, until all answered: an explicit round trip per batch (the shape of a synchronous
  IPC broadcast), which elastickv does not make; an upper bound on what R ranks add.

    python benchmarks/bench_grants.py            # rich table
    python benchmarks/bench_grants.py --json     # machine-readable
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import pickle
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from multiprocessing.connection import Connection

from elastickv.vmm import DEFAULT_PAGE_SIZE, HostBackend
from elastickv.vmm.base import VirtualRange
from elastickv.vmm.grants import GrantFollower, PageGrants, PageOps


@dataclass(frozen=True)
class Row:
    """One measurement: the protocol's µs and the direct call's, per page and per batch."""

    part: str
    operation: str
    pattern: str
    pages: int
    ranks: int
    us_per_page: float
    baseline_us_per_page: float | None
    ratio: float | None
    us_per_batch: float
    note: str = ""


def page_lists(num_pages: int, batch: int, pattern: str) -> list[list[int]]:
    """Batches of ``batch`` pages: consecutive runs, or every other page (scattered)."""
    stride = 1 if pattern == "contiguous" else 2
    span = batch * stride
    return [
        list(range(first, first + span, stride)) for first in range(0, num_pages - span + 1, span)
    ]


def granted(grants: PageGrants, pages: Sequence[int], *, commit: bool) -> PageOps:
    """The batch the scheduler drains after committing (or releasing) ``pages``."""
    if commit:
        grants.commit(pages)
    else:
        grants.release(pages)
    ops = grants.drain()
    assert ops is not None
    return ops


def touch(vrange: VirtualRange, pages: Sequence[int]) -> None:
    """Write every page, as a KV cache's pages are before they are released."""
    for page in pages:
        ctypes.memset(vrange.base_address + page * vrange.page_size, 1, vrange.page_size)


def timed_us(call: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    call()
    return (time.perf_counter_ns() - start) / 1000


def worker_rows(page_size: int, num_pages: int, repeats: int, batch: int) -> list[Row]:
    """Follower vs direct calls, alternating call by call (who goes first alternates too)."""
    backend = HostBackend(page_size=page_size)
    rows: list[Row] = []
    for pattern in ("contiguous", "scattered"):
        batches = page_lists(num_pages, batch, pattern)
        samples: dict[str, list[float]] = {k: [] for k in ("fc", "dc", "fr", "dr")}
        with (
            backend.reserve(num_pages * page_size) as ours,
            backend.reserve(num_pages * page_size) as direct,
        ):
            follower = GrantFollower(ours)
            grants = PageGrants(num_pages * page_size, page_size)
            for repeat in range(repeats):
                for index, pages in enumerate(batches):
                    commit_ops = granted(grants, pages, commit=True)
                    release_ops = granted(grants, pages, commit=False)
                    pair: list[tuple[str, Callable[[], object]]] = [
                        ("f", partial(follower.apply, commit_ops)),
                        ("d", partial(direct.commit, pages)),
                    ]
                    if (index + repeat) % 2:
                        pair.reverse()
                    for side, call in pair:
                        samples[side + "c"].append(timed_us(call))
                    touch(ours, pages)
                    touch(direct, pages)
                    pair = [
                        ("f", partial(follower.apply, release_ops)),
                        ("d", partial(direct.release, pages)),
                    ]
                    if (index + repeat) % 2:
                        pair.reverse()
                    for side, call in pair:
                        samples[side + "r"].append(timed_us(call))
            assert ours.footprint_bytes() == 0 and direct.footprint_bytes() == 0
        for phase, operation in (("c", "commit"), ("r", "release")):
            mine, theirs = samples["f" + phase], samples["d" + phase]
            rows.append(
                Row(
                    part="worker",
                    operation=operation,
                    pattern=pattern,
                    pages=batch,
                    ranks=1,
                    us_per_page=round(statistics.median(mine) / batch, 2),
                    baseline_us_per_page=round(statistics.median(theirs) / batch, 2),
                    ratio=round(
                        statistics.median(a / b for a, b in zip(mine, theirs, strict=True)), 3
                    ),
                    us_per_batch=round(statistics.median(mine), 2),
                )
            )
    return rows


def scheduler_rows(num_pages: int, repeats: int, batch: int) -> list[Row]:
    """Recording ``batch`` page commits (then releases) in :class:`PageGrants` and draining
    them, and the drained batch's size and pickle round trip."""
    rows: list[Row] = []
    for pattern in ("contiguous", "scattered"):
        batches = page_lists(num_pages, batch, pattern)
        grants = PageGrants(num_pages * 4096, 4096)  # no memory: the page size is a label
        record: list[float] = []
        wire: list[float] = []
        size = 0
        for _ in range(repeats):
            for pages in batches:
                for call in (grants.commit, grants.release):
                    start = time.perf_counter_ns()
                    call(pages)
                    ops = grants.drain()
                    record.append((time.perf_counter_ns() - start) / 1000)
                    start = time.perf_counter_ns()
                    data = pickle.dumps(ops)
                    pickle.loads(data)
                    wire.append((time.perf_counter_ns() - start) / 1000)
                    size = max(size, len(data))
        per_batch = statistics.median(record)
        rows.append(
            Row("scheduler", "record + drain", pattern, batch, 1,
                round(per_batch / batch, 2), None, None, round(per_batch, 2))
        )  # fmt: skip
        rows.append(
            Row("transport", "pickle + unpickle", pattern, batch, 1,
                round(statistics.median(wire) / batch, 2), None, None,
                round(statistics.median(wire), 2), note=f"{size} bytes pickled")
        )  # fmt: skip
    return rows


def rank_main(connection: Connection, page_size: int, num_pages: int) -> None:
    """One worker process: its own range and follower; applies each batch it receives and
    answers with the µs the apply took."""
    with HostBackend(page_size=page_size).reserve(num_pages * page_size) as vrange:
        follower = GrantFollower(vrange)
        while True:
            ops = connection.recv()
            if ops is None:
                break
            connection.send(timed_us(partial(follower.apply, ops)))


def rank_rows(page_size: int, num_pages: int, repeats: int, batch: int, ranks: int) -> Row:
    """A contiguous commit batch sent to ``ranks`` processes until all answered (each then
    releases it, untimed)."""
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(ranks)]
    workers = [
        context.Process(target=rank_main, args=(child, page_size, num_pages), daemon=True)
        for _, child in pipes
    ]
    for worker in workers:
        worker.start()
    round_trips: list[float] = []
    applies: list[float] = []
    grants = PageGrants(num_pages * page_size, page_size)
    try:
        for _ in range(repeats):
            for pages in page_lists(num_pages, batch, "contiguous"):
                commit = granted(grants, pages, commit=True)
                release = granted(grants, pages, commit=False)
                start = time.perf_counter_ns()
                for parent, _ in pipes:
                    parent.send(commit)
                answers = [parent.recv() for parent, _ in pipes]
                round_trips.append((time.perf_counter_ns() - start) / 1000)
                applies.append(max(answers))
                for parent, _ in pipes:
                    parent.send(release)
                for parent, _ in pipes:
                    parent.recv()
    finally:
        for parent, _ in pipes:
            parent.send(None)
        for worker in workers:
            worker.join(timeout=30)
    per_batch = statistics.median(round_trips)
    return Row(
        part="ranks",
        operation="commit round trip",
        pattern="contiguous",
        pages=batch,
        ranks=ranks,
        us_per_page=round(per_batch / batch, 2),
        baseline_us_per_page=round(statistics.median(applies) / batch, 2),
        ratio=None,
        us_per_batch=round(per_batch, 2),
        note="baseline: the slowest rank's apply alone",
    )


def print_rows(rows: list[Row], header: dict[str, object]) -> None:
    from rich.table import Table

    from elastickv.cli.tables import output_console, print_table

    title = ", ".join(f"{k}={v}" for k, v in header.items())
    table = Table(title=f"granting pages: scheduler, transport, worker ({title})")
    columns = ("part", "operation", "pattern", "pages", "ranks", "µs/page", "direct µs/page",
               "ratio", "µs/batch", "note")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("part", "operation", "pattern",
                                                               "note") else "right")  # fmt: skip
    for r in rows:
        table.add_row(
            r.part, r.operation, r.pattern, str(r.pages), str(r.ranks),
            f"{r.us_per_page:.2f}",
            "" if r.baseline_us_per_page is None else f"{r.baseline_us_per_page:.2f}",
            "" if r.ratio is None else f"{r.ratio:.3f}",
            f"{r.us_per_batch:.2f}", r.note,
        )  # fmt: skip
    print_table(output_console(), table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument("--pages", type=int, default=64, help="pages of each range (64)")
    parser.add_argument("--repeats", type=int, default=10, help="passes over the range (10)")
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[1, 2, 4], help="worker processes (1 2 4)"
    )
    args = parser.parse_args(argv)
    if args.pages < 16 or args.repeats < 1 or any(r < 1 for r in args.ranks):
        parser.error("--pages must be at least 16, --repeats and --ranks at least 1")
    started = time.perf_counter()
    rows: list[Row] = []
    for batch in (1, 8):
        rows += worker_rows(args.page_size, args.pages, args.repeats, batch)
    rows += scheduler_rows(args.pages, args.repeats * 10, 8)
    for ranks in args.ranks:
        rows.append(rank_rows(args.page_size, args.pages, args.repeats, 1, ranks))
    header: dict[str, object] = {
        "page_size": args.page_size,
        "pages": args.pages,
        "repeats": args.repeats,
        "wall_s": round(time.perf_counter() - started, 2),
    }
    if args.json:
        print(json.dumps({**header, "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print_rows(rows, header)


if __name__ == "__main__":
    main()
