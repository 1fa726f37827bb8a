"""Names are never cut: ``list``, ``top --once`` and the other tables through a pipe (also
with ``COLUMNS=80``) and on a narrow terminal show every instance name whole, and no header
loses characters to an ellipsis."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from elastickv.cli.instances import render_list
from elastickv.cli.tables import fitted, output_console, print_table
from elastickv.cli.top_view import render_frame
from elastickv.control import ENV_DIR, Ledger, open_ledger
from elastickv.probes.vmm_probe import ProbeResult, _print_table

SCRIPT = Path(sys.executable).with_name("elastickv")
MiB = 1 << 20
# What vLLM's OpenAI server registers: "<served model name>:<port>", here a long one.
LONG_NAME = "tiny-llama-294ab082c3d14f6e9a7b-elastic-instance:8000"
ELLIPSIS = "…"


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "ledgers"))
    with open_ledger(total_bytes=64 * MiB, utilization=1.0) as opened:
        yield opened


def piped(*args: str, columns: str | None) -> str:
    """The console script with stdout a pipe (never a terminal), as in a log or `| grep`."""
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    if columns is not None:
        env["COLUMNS"] = columns
    result = subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("columns", [None, "80", "40"])
def test_list_and_top_through_a_pipe_show_the_whole_name(
    ledger: Ledger, columns: str | None
) -> None:
    with ledger.register(LONG_NAME, limit="8M") as handle, ledger.register("b") as other:
        assert handle.try_admit(2 * MiB) and other.try_admit(MiB)
        listed = piped("list", columns=columns)
        top = piped("top", "--once", columns=columns)
    assert ELLIPSIS not in listed and ELLIPSIS not in top
    header = next(line for line in listed.splitlines() if line.startswith("NAME"))
    assert header.split() == [
        "NAME", "PID", "LIMIT", "EFFECTIVE", "REV", "COMMITTED", "RESERVED", "STATE",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in listed.splitlines()[2:]}
    assert rows[LONG_NAME][1:6] == [str(os.getpid()), "8.0", "MiB", "8.0", "MiB"]
    assert any(line.split()[0] == LONG_NAME for line in top.splitlines() if line.strip())
    assert any(line.split() == ["NAME", "USED", "/", "LIMIT", "STATE"] for line in top.splitlines())


def test_a_narrow_terminal_keeps_names_and_figures_whole(ledger: Ledger) -> None:
    with ledger.register(LONG_NAME) as handle:
        assert handle.try_admit(3 * MiB)
        snap = ledger.snapshot()
    out = io.StringIO()
    console = Console(file=out, width=60, force_terminal=True, color_system=None)
    render_list(snap, console)
    console.print(render_frame(snap, device="host", interval=1.0, columns=60), crop=False)
    text = out.getvalue()
    assert ELLIPSIS not in text
    assert sum(LONG_NAME in line for line in text.splitlines()) == 2  # list and top
    row = next(line for line in text.splitlines() if line.startswith(LONG_NAME))
    assert f" {os.getpid()} " in row  # the pid not wrapped over two lines


def test_every_header_is_whole_however_narrow() -> None:
    headers = ("MODEL", "KV COMMITTED (of 32.0 MiB shared)", "IN-FLIGHT")
    table = Table(*headers, box=None)
    table.add_row("tiny-llama-bf16", "12.0 MiB", "3")
    out = io.StringIO()
    print_table(Console(file=out, width=20, force_terminal=True, color_system=None), table)
    lines = out.getvalue().splitlines()
    assert [h in lines[0] for h in headers] == [True] * 3 and "tiny-llama-bf16" in lines[1]


def test_fitted_drops_ellipsis_and_caps() -> None:
    table = Table()
    table.add_column("NAME", max_width=4, overflow="ellipsis")
    table.add_row("[bold]a-long-name[/]")
    column = fitted(table).columns[0]
    assert column.min_width == len("a-long-name") and column.max_width is None
    assert column.overflow == "fold"


def test_a_piped_console_has_natural_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    console = output_console(file=io.StringIO())
    assert not console.is_terminal and console.width > 200


def test_the_probe_table_keeps_its_headers(capsys: pytest.CaptureFixture[str]) -> None:
    result = ProbeResult(case="straddling-blocks-with-long-name", layout="NHD", backend="host")
    _print_table([result])
    assert ELLIPSIS not in capsys.readouterr().out


def test_layout_explain_through_a_pipe_at_80_columns() -> None:
    out = piped("layout", "explain", "--model", "llama-3-8b", "--layout", "NHD", columns="80")
    assert ELLIPSIS not in out
    assert "storage_offset" in out and "pages one block touches (all layers)" in out
