"""``elastickv top``: a live view of a device's ledger, refreshed every ``--interval`` seconds.
On a terminal each frame replaces the last; into a pipe or a file, the frames follow each
other, a blank line between them.

The ledger stays open between frames (one snapshot per frame, no polling in between); if it is
missing or damaged the frame says so and the next tick tries again, so ``top`` can be started
before the first instance and survives a ``doctor --reset-ledger``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import termios
import threading
import time
import tty
from types import TracebackType
from typing import IO, Any, Self

from rich.console import RenderableType
from rich.live import Live

from elastickv.cli.errors import UserError
from elastickv.cli.ledger_view import (
    add_device_argument,
    device_path,
    ledger_exists,
    no_ledger_message,
)
from elastickv.cli.tables import output_console
from elastickv.cli.top_view import render_frame
from elastickv.control import Ledger, LedgerError, LedgerSnapshot
from elastickv.serve.state_file import model_states

QUIT_KEYS = frozenset(b"qQ")


def register(commands: Any) -> None:
    p = commands.add_parser(
        "top",
        help="live view of the instances on a device",
        description="Per-instance bars (used vs effective limit, draining shown) and the device "
        "total, refreshed every --interval seconds. Press q or Ctrl-C to quit.",
    )
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (1)"
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    add_device_argument(p)
    p.set_defaults(run=run_top)


class LedgerSource:
    """Snapshots for successive frames; reopens the ledger after it appears or is repaired."""

    def __init__(self, device: str) -> None:
        self._device = device
        self._path = device_path(device)
        self._ledger: Ledger | None = None

    def read(self) -> tuple[LedgerSnapshot | None, str | None]:
        """A snapshot, or None and the reason there is none."""
        try:
            if self._ledger is None:
                if not ledger_exists(self._path):
                    return None, no_ledger_message(self._device, self._path) + "; waiting"
                self._ledger = Ledger.open(self._device, create=False)
            return self._ledger.snapshot(), None
        except LedgerError as err:
            self.close()
            return None, str(err)

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class KeyReader:
    """Waits for the next frame while watching stdin for a quit key and for Ctrl-C. On a
    terminal, input is switched to cbreak mode (keys arrive unbuffered) and restored.

    Ctrl-C (SIGINT) only wakes the wait, through a pipe: a ``KeyboardInterrupt`` raised
    wherever the signal lands (mid-frame, or in the cleanup after a first Ctrl-C) would skip
    restoring the terminal and print a traceback. After a Ctrl-C, further ones are ignored
    while the program quits."""

    def __init__(self, stream: IO[str]) -> None:
        try:
            self._fd: int | None = stream.fileno()
        except (OSError, ValueError):
            self._fd = None
        self._saved: list[Any] | None = None
        self._wake: tuple[int, int] | None = None
        self._previous_handler: Any = None
        self.interrupted = False

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._wake = os.pipe()
            for fd in self._wake:
                os.set_blocking(fd, False)
            self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        if self._fd is not None and os.isatty(self._fd):
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd, termios.TCSANOW)
        return self

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.interrupted = True
        if self._wake is not None:
            with contextlib.suppress(OSError):  # the pipe is full: a wake-up is pending
                os.write(self._wake[1], b"!")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._saved is not None and self._fd is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
        if self._wake is not None:
            quitting = self.interrupted or exc_type is not None
            signal.signal(signal.SIGINT, signal.SIG_IGN if quitting else self._previous_handler)
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if a quit key was pressed or Ctrl-C came meanwhile."""
        deadline = time.monotonic() + seconds
        watched = [fd for fd in (self._fd, self._wake[0] if self._wake else None) if fd is not None]
        while (left := deadline - time.monotonic()) > 0:
            if not watched:
                time.sleep(left)
                break
            ready, _, _ = select.select(watched, [], [], left)
            if not ready:
                break
            if self._wake is not None and self._wake[0] in ready:
                return True
            data = os.read(ready[0], 64)
            if not data:
                watched.remove(ready[0])  # end of input: keep refreshing until interrupted
                self._fd = None
            elif QUIT_KEYS.intersection(data):
                return True
        return False


def run_top(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise UserError(f"--interval must be a positive number of seconds, got {args.interval}")
    console = output_console()
    with LedgerSource(args.device) as source:

        def frame() -> RenderableType:
            snap, problem = source.read()
            return render_frame(
                snap,
                device=args.device,
                interval=args.interval,
                problem=problem,
                quit_hint=not args.once,
                columns=console.width,
                served=model_states() if args.device == "host" else {},
            )

        if args.once:
            console.print(frame(), crop=False)
            return 0
        if not console.is_terminal:
            # A pipe or a log: one frame after the other, each written at once (rich's live
            # display shows nothing but its last frame there, so `timeout 5 elastickv top`
            # printed nothing at all).
            with KeyReader(sys.stdin) as keys:
                while True:
                    console.print(frame(), crop=False)
                    console.print()
                    console.file.flush()
                    if keys.wait(args.interval):
                        break
            return 0
        live = Live(
            frame(),
            console=console,
            auto_refresh=False,
            screen=console.is_terminal,  # full screen on a terminal, restored on exit
            redirect_stdout=False,
            redirect_stderr=False,
        )
        with KeyReader(sys.stdin) as keys, live:
            while not keys.wait(args.interval):
                live.update(frame(), refresh=True)
    return 0
