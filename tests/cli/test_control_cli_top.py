"""``elastickv top`` driven under a pseudo-terminal against live instances, plus ``--once``
and the frame renderer on its own."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from elastickv.cli.top_view import COMMITTED, FREE, RESERVED, render_frame, usage_bar
from elastickv.control import ENV_DIR, Ledger, open_ledger

SCRIPT = Path(sys.executable).with_name("elastickv")
MiB = 1 << 20
BUDGET = 64 * MiB
ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|[()][0-9A-Za-z]|[=>78])")


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "ledgers"))
    with open_ledger(total_bytes=BUDGET, utilization=1.0) as opened:
        yield opened


class Terminal:
    """``elastickv top`` on the slave side of a pty (100 x 30), read from the master side."""

    def __init__(self, *args: str) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "30"}
        self.proc = subprocess.Popen(
            [str(SCRIPT), "top", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            close_fds=True,
        )
        self.slave = slave
        self.raw = b""

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def read_until(self, predicate: str, timeout: float = 60.0) -> str:
        """Read output until ``predicate`` appears after the current position."""
        start = len(self.text)
        deadline = time.monotonic() + timeout
        while predicate not in self.text[start:]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{predicate!r} not shown; screen so far:\n{self.text}")
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.raw += os.read(self.master, 65536)
                except OSError:  # the child closed the terminal
                    if self.proc.poll() is not None:
                        raise AssertionError(f"top exited; screen:\n{self.text}") from None
        return self.text[start:]

    def drain(self) -> None:
        while select.select([self.master], [], [], 0.05)[0]:
            try:
                self.raw += os.read(self.master, 65536)
            except OSError:
                return

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.drain()
            time.sleep(0.05)
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminal() -> Iterator[list[Terminal]]:
    opened: list[Terminal] = []
    yield opened
    for term in opened:
        term.close()


def test_top_shows_bars_refreshes_and_quits_on_q(ledger: Ledger, terminal: list[Terminal]) -> None:
    with ledger.register("llama-a", limit="16M") as a:
        assert a.try_admit(8 * MiB) and a.set_reserved_bytes(4 * MiB)
        term = Terminal("--interval", "0.2")
        terminal.append(term)
        frame = term.read_until("r1")
        assert "elastickv top" in frame and "llama-a" in frame
        assert COMMITTED in frame and RESERVED in frame and FREE in frame
        assert "12.0 MiB / 16.0 MiB" in frame
        assert "12.0 MiB / 64.0 MiB" in frame  # the device total
        assert termios.tcgetattr(term.slave)[3] & termios.ICANON == 0  # keys unbuffered

        with ledger.register("qwen-b") as b:
            assert b.try_admit(20 * MiB)
            frame = term.read_until("qwen-b")
            term.read_until("32.0 MiB / 64.0 MiB")
        ledger.set_limit("llama-a", "4M")
        term.read_until("draining 8.0 MiB")  # what it holds above the limit: reserve and pages
        os.write(term.master, b"q")
        assert term.wait() == 0
    assert termios.tcgetattr(term.slave)[3] & termios.ICANON  # the terminal is restored


def test_top_quits_cleanly_on_sigint(ledger: Ledger, terminal: list[Terminal]) -> None:
    with ledger.register("llama-a"):
        term = Terminal("--interval", "0.2")
        terminal.append(term)
        term.read_until("llama-a")
        term.proc.send_signal(signal.SIGINT)
        assert term.wait() == 0
        assert "Traceback" not in term.text
        assert termios.tcgetattr(term.slave)[3] & termios.ICANON


def test_top_quits_cleanly_on_repeated_sigint(ledger: Ledger, terminal: list[Terminal]) -> None:
    """Ctrl-C pressed again while top is already quitting (or mid-frame): no traceback, the
    terminal restored. A KeyboardInterrupt raised wherever the signal lands escaped the
    cleanup; top now only notes the signal and quits between frames."""
    with ledger.register("llama-a"):
        term = Terminal("--interval", "0.05")
        terminal.append(term)
        term.read_until("llama-a")
        for _ in range(30):
            if term.proc.poll() is not None:
                break
            term.proc.send_signal(signal.SIGINT)
            time.sleep(0.002)
        assert term.wait() == 0, term.text[-2000:]
        assert "Traceback" not in term.text
        assert termios.tcgetattr(term.slave)[3] & termios.ICANON


def test_top_waits_for_a_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, terminal: list[Terminal]
) -> None:
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "ledgers"))
    term = Terminal("--interval", "0.2")
    terminal.append(term)
    term.read_until("waiting")
    with open_ledger(total_bytes=BUDGET) as ledger, ledger.register("late-comer"):
        term.read_until("late-comer")
    os.write(term.master, b"q")
    assert term.wait() == 0


def test_top_once_prints_one_frame(ledger: Ledger) -> None:
    with ledger.register("llama-a") as a:
        assert a.try_admit(32 * MiB)
        result = subprocess.run(
            [str(SCRIPT), "top", "--once"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode == 0, result.stderr
    assert "llama-a" in result.stdout and COMMITTED in result.stdout
    assert "32.0 MiB / 64.0 MiB" in result.stdout
    assert "q or Ctrl-C" not in result.stdout


def test_top_rejects_a_bad_interval(ledger: Ledger) -> None:
    result = subprocess.run(
        [str(SCRIPT), "top", "--interval", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2 and "--interval must be a positive" in result.stderr


def test_usage_bar_cells() -> None:
    assert usage_bar(0, 0, 100, width=10).plain == FREE * 10
    assert usage_bar(50, 20, 100, width=10).plain == COMMITTED * 5 + RESERVED * 2 + FREE * 3
    assert usage_bar(200, 0, 100, width=10).plain == COMMITTED * 10
    assert usage_bar(5, 0, 0, width=4).plain == COMMITTED * 4
    over = usage_bar(10, 0, 8, width=4, over=True)
    assert {span.style for span in over.spans} == {"red"}


def test_frame_fits_the_terminal(ledger: Ledger) -> None:
    with ledger.register("a-rather-long-instance-name") as a, ledger.register("b"):
        assert a.try_admit(6 * MiB)
        ledger.set_limit(a.name, "2M")
        console = Console(record=True, width=80, color_system=None)
        console.print(render_frame(ledger.snapshot(), device="host", interval=1.0))
    screen = console.export_text()
    assert all(len(line) <= 80 for line in screen.splitlines())
    assert "draining 4.0 MiB" in screen and "a-rather-long" in screen


def test_frame_shows_the_state_of_served_models(ledger: Ledger) -> None:
    with ledger.register("chat"), ledger.register("other"):
        console = Console(record=True, width=100, color_system=None)
        frame = render_frame(
            ledger.snapshot(), device="host", interval=1.0, served={"chat": "kv-released"}
        )
        console.print(frame)
    lines = console.export_text().splitlines()
    chat = next(line for line in lines if line.startswith("chat"))
    other = next(line for line in lines if line.startswith("other"))
    assert "kv-released" in chat and "kv-released" not in other


def test_frame_keeps_every_state_whole_at_80_columns(ledger: Ledger) -> None:
    """At 80 columns the state was cut (``limit 4.0 MiB r11 i``): the bars now take only
    what the names, figures and states leave, and none when too little is left."""
    with ledger.register("tiny-llama") as a, ledger.register("tiny-llama-bf16") as b:
        assert a.try_admit(576 << 10) and b.try_admit(2 * MiB)
        for _ in range(10):
            ledger.set_limit(a.name, "4M")
        ledger.set_limit(b.name, "384K")  # b drains 1.6 MiB
        served = {"tiny-llama": "idle", "tiny-llama-bf16": "kv-released"}
        screens = {}
        for columns in (80, 76):
            console = Console(record=True, width=columns, color_system=None)
            frame = render_frame(
                ledger.snapshot(), device="host", interval=1.0, columns=columns, served=served
            )
            console.print(frame)
            screens[columns] = console.export_text()
    for columns, screen in screens.items():
        lines = screen.splitlines()
        assert all(len(line) <= columns for line in lines), (columns, screen)
        row_a = next(line for line in lines if line.startswith("tiny-llama "))
        row_b = next(line for line in lines if line.startswith("tiny-llama-bf16"))
        assert row_a.rstrip().endswith("limit 4.0 MiB r11 idle"), screen
        assert row_b.rstrip().endswith("draining 1.6 MiB kv-released"), screen
        assert "576.0 KiB / 4.0 MiB" in row_a
    rows = {c: [line for line in screen.splitlines() if line.startswith("tiny-llama")]
            for c, screen in screens.items()}  # fmt: skip
    assert all(COMMITTED in row for row in rows[80])  # room for bars at 80 columns
    assert not any(COMMITTED in row or FREE in row for row in rows[76])  # too little at 76


def test_top_into_a_pipe_writes_each_frame_as_it_comes(ledger: Ledger) -> None:
    """``timeout 5 elastickv top`` (or ``| cat``) printed nothing for the whole time."""
    with ledger.register("piped-instance"):
        proc = subprocess.Popen(
            [str(SCRIPT), "top", "--interval", "0.2"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            out = proc.stdout.fileno()
            data = b""
            deadline = time.monotonic() + 60  # a failsafe: three frames take 0.4 s
            while data.count(b"elastickv top") < 3:  # three frames while top keeps running
                left = deadline - time.monotonic()
                assert left > 0, f"no three frames from a running top: {data!r}"
                if select.select([out], [], [], left)[0]:
                    chunk = os.read(out, 65536)
                    assert chunk, f"top ended early: {data!r}"
                    data += chunk
            seen = data.decode().splitlines()
            assert proc.poll() is None
            assert any(line.startswith("piped-instance") for line in seen)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
            assert proc.stderr is not None and proc.stderr.read() == b""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
