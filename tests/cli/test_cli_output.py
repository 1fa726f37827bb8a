"""What every command prints besides its answer: help texts as written, and a reader that
stops reading (``| head``) is not an error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastickv.cli.main import COMMANDS

SCRIPT = (sys.executable, "-m", "elastickv.cli.main")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_percent_signs_as_typed(command: str) -> None:
    """``elastickv limit --help`` showed ``(30%%)``."""
    result = subprocess.run(
        [*SCRIPT, command, "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "%%" not in result.stdout
    if command == "limit":
        assert "(30%)" in result.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["layout", "explain", "--model", "llama-3-8b"],
        ["layout", "explain", "--model", "llama-3-8b", "--json"],
        ["layout", "tour"],
        ["models"],
    ],
)
def test_a_closed_pipe_ends_the_command_quietly(argv: list[str]) -> None:
    """``elastickv layout explain ... | head`` exited with status 1. Here the reading end is
    closed before the command writes, so its first write finds the pipe closed."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [*SCRIPT, *argv], stdout=write_end, stderr=subprocess.PIPE, timeout=120, check=False
        )
    finally:
        os.close(write_end)
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""
