"""``elastickv demo``: the main job. It starts ``elastickv serve`` with the two built-in tiny
models on one small KV budget, drives a bursty load at each model in turn, and shows each
model's committed KV memory growing with its burst and shrinking when it idles, live. It then
writes a picture of the run, prints a three-line summary, and stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from elastickv.cli.errors import UserError
from elastickv.cli.tables import fitted, output_console
from elastickv.cli.top_view import usage_bar
from elastickv.units import format_bytes

MODELS = ("tiny-llama", "tiny-llama-bf16")
BUDGET = 12 << 20
RELEASE_AFTER_S = 4
# After the load, keep watching until every model has released its KV (RELEASE_AFTER_S idle,
# then serve's next idle check), so the release shows; at most this long.
RELEASE_WAIT_S = 60.0


def register(commands: Any) -> None:
    p = commands.add_parser(
        "demo",
        help="serve the built-in models under a bursty load, live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--plot", type=Path, default=Path("elastickv-demo.png"), help="picture of the run (PNG)"
    )
    p.add_argument("--peak", type=int, default=6, help="peak requests/s of each burst")
    p.add_argument("--python", help="the Python with vLLM for the engines (default: found)")
    p.set_defaults(run=run_demo)


def _config(work: Path, port: int, python: str | None) -> Path:
    lines = [f'log_dir = "{work / "logs"}"']
    if python:
        lines.append(f'python = "{python}"')
    lines += [
        "[router]", f"port = {port}", "queue_limit = 256",
        "[device]", f"budget = {BUDGET}", 'page_size = "64K"',
    ]  # fmt: skip
    for model in MODELS:
        lines += [
            "[[model]]", f'model = "{model}"', 'args = ["--enforce-eager", "--block-size", "32"]',
            'min_kv = "1M"', f'release_after = "{RELEASE_AFTER_S}s"', 'stop_after = "never"',
        ]  # fmt: skip
    path = work / "demo.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_demo(args: argparse.Namespace) -> int:
    if args.peak < 1:
        raise UserError(f"--peak must be at least 1, got {args.peak}")
    console = output_console()
    from elastickv.ports import free_port

    with tempfile.TemporaryDirectory(prefix="elastickv-demo-") as tmp:
        work = Path(tmp)
        port = free_port()
        config = _config(work, port, args.python)
        env = dict(os.environ, ELASTICKV_LEDGER_DIR=str(work / "ledger"), HF_HUB_OFFLINE="1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        log = work / "serve.log"
        console.print(
            f"starting [bold]elastickv serve[/] with {' and '.join(MODELS)} on a shared KV "
            f"budget of {format_bytes(BUDGET)} (about a minute on 2 cores)"
        )
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "elastickv.cli.main", "serve", "--config", str(config)],
                env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            with console.status("engines starting…"):
                _wait_ready(proc, base, log)
            console.print(f"serving at {base}/v1; bursts of up to {args.peak} requests/s, in turn")
            outcome = asyncio.run(_drive(base, args.peak, console))
        finally:
            left = _stop(proc)
        console.print(
            "stopped elastickv serve: "
            + (f"processes still running: {left}" if left else "nothing left running")
        )
        _report(outcome, args.plot, console)
        return 0 if outcome["failed"] == 0 and not left else 1


def _wait_ready(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    from elastickv.bench.monitor import serve_ready

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(f"elastickv serve exited during start-up:\n{log.read_text()[-3000:]}")
        if serve_ready(base):
            return
        time.sleep(0.5)
    raise UserError(f"elastickv serve did not become ready in 600 s:\n{log.read_text()[-3000:]}")


async def _drive(base: str, peak: int, console: Console) -> dict[str, Any]:
    import aiohttp

    from elastickv.bench.client import run_schedule
    from elastickv.bench.monitor import Monitor
    from elastickv.bench.workloads import Shape, staggered_ramp

    arrivals = staggered_ramp(MODELS, peak, shape=Shape(256, 32, 64), seed=0)
    monitor = Monitor(base, MODELS)
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        watch = asyncio.create_task(monitor.run(session, start))
        load = asyncio.create_task(run_schedule(base, arrivals))
        live = Live(_view(monitor, 0.0, len(arrivals), False), console=console,
                    refresh_per_second=4, transient=False)  # fmt: skip
        with live if console.is_terminal else contextlib.nullcontext():
            last_line = 0.0
            until: float | None = None
            while True:
                if load.done() and until is None:
                    until = time.monotonic() + RELEASE_WAIT_S
                elapsed = time.monotonic() - start
                ended = until is not None and (_all_released(monitor) or time.monotonic() > until)
                if console.is_terminal:
                    live.update(_view(monitor, elapsed, len(arrivals), load.done()))
                elif ended or elapsed - last_line >= 2.0:  # the last state is always shown
                    last_line = elapsed
                    console.print(_line(monitor, elapsed), highlight=False, soft_wrap=True)
                if ended:
                    break
                await asyncio.sleep(0.25)
        watch.cancel()
        results = await load
    failed = sum(not r.ok for r in results)
    return {"results": results, "memory": monitor.memory, "states": monitor.states,
            "failed": failed, "seconds": time.monotonic() - start}  # fmt: skip


def _all_released(monitor: Any) -> bool:
    """Whether serve's last answer showed every model with its KV released."""
    states = {m["name"]: m["state"] for m in monitor.latest}
    return set(states) == set(MODELS) and set(states.values()) <= {"kv-released", "asleep"}


def _view(monitor: Any, elapsed: float, total: int, done: bool) -> Group:
    table = Table(box=None, pad_edge=False)
    for column in ("MODEL", "STATE", f"KV COMMITTED (of {format_bytes(BUDGET)} shared)", "", ""):
        table.add_column(column, no_wrap=True)
    for m in monitor.latest:
        used = m["committed_bytes"] or 0
        table.add_row(
            m["name"], m["state"], usage_bar(used, 0, BUDGET, width=32),
            format_bytes(used), f"{m['in_flight']} in flight",
        )  # fmt: skip
    title = Text(f"elastickv demo  {elapsed:5.1f} s  {total} requests", style="bold")
    note = "load done; idle models release their KV…" if done else "bursty load running…"
    return Group(title, fitted(table), Text(note, style="bright_black"))


def _line(monitor: Any, elapsed: float) -> str:
    parts = [
        f"{m['name']} {m['state']} {format_bytes(m['committed_bytes'] or 0)}"
        for m in monitor.latest
    ]
    return f"{elapsed:5.1f} s  " + "  |  ".join(parts)


def _stop(proc: subprocess.Popen[bytes]) -> list[int]:
    """SIGTERM serve, wait for it; the processes of its session still alive (none, normally)."""
    from elastickv.serve.engine import stop_session

    return stop_session(proc, timeout=90)


def _report(outcome: dict[str, Any], plot: Path, console: Console) -> None:
    from elastickv.bench.plot import plot_run
    from elastickv.bench.stats import memory_seconds, per_model

    results = outcome["results"]
    summary = per_model(results, MODELS)
    try:
        path = plot_run(
            plot, {"elastickv serve": outcome}, MODELS, BUDGET,
            f"elastickv demo: {len(results)} requests, shared KV budget {format_bytes(BUDGET)}",
        )  # fmt: skip
        console.print(f"picture of the run: {path.resolve()}")
    except ImportError:
        console.print("no picture: matplotlib is not installed (pip install 'elastickv[bench]')")
    everything = summary["all"]
    peaks = {m: max((s.get(m, 0) for _, s in outcome["memory"]), default=0) for m in MODELS}
    used = memory_seconds(outcome["memory"])
    static = BUDGET / len(MODELS) * outcome["seconds"] / (1 << 30)
    ms = 1000.0
    console.print(
        f"1. {everything['requests'] - everything['failed']}/{everything['requests']} requests "
        f"served, {everything['failed']} failed; TTFT p50 {(everything['ttft_p50'] or 0) * ms:.0f}"
        f" ms, p99 {(everything['ttft_p99'] or 0) * ms:.0f} ms",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        "2. each model's burst took what it needed of the shared budget: peak "
        + ", ".join(f"{m} {format_bytes(b)}" for m, b in peaks.items())
        + f" (a static split gives each {format_bytes(BUDGET // len(MODELS))})",
        highlight=False,
        soft_wrap=True,
    )
    released = [m for m, states in outcome["states"].items() if "kv-released" in states]
    console.print(
        f"3. idle models released their KV ({', '.join(released) or 'none yet'}): "
        f"{sum(used.values()):.3f} GiB·s of KV held, vs {len(MODELS) * static:.3f} for a static "
        "split over the same time",
        highlight=False,
        soft_wrap=True,
    )
