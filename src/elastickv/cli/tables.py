"""The one way the command line builds consoles and prints tables, so nothing is cut.

An instance name is what ``elastickv limit NAME`` needs, so it must be copyable from any
output: a column is never narrower than its header or its longest cell (names, figures and
headers are neither shortened nor wrapped), and output that goes to a pipe or a log is
written at its natural width instead of rich's 80-column guess. On a terminal narrower than
a table, the terminal wraps the long lines; no character is replaced by an ellipsis.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, RenderableType
from rich.table import Column, Table
from rich.text import Text

# Width of output that is not a terminal: wide enough for any table we print, so every line
# comes out at its natural length (rich pads nothing when a table does not expand).
PIPE_WIDTH = 1000


class _OutputConsole(Console):
    """rich's console, except that a reader closing the pipe (``| head``) is not an error:
    rich exits with status 1 there; the command line's ``main`` exits with 0."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def output_console(**kwargs: Any) -> Console:
    """A console for command output: the terminal's width, or natural width when piped."""
    console = _OutputConsole(**kwargs)
    if not console.is_terminal:
        console.width = PIPE_WIDTH
    return console


def cell_width(renderable: RenderableType | None) -> int:
    """Cells a table cell needs on one line (markup stripped); 0 for what is not text."""
    if isinstance(renderable, str):
        return max((Text.from_markup(line).cell_len for line in renderable.splitlines()), default=0)
    if isinstance(renderable, Text):
        return max((line.cell_len for line in renderable.split()), default=0)
    return 0


def _fit_column(column: Column) -> None:
    need = max([cell_width(column.header), *(cell_width(cell) for cell in column.cells)])
    column.min_width = max(column.min_width or 0, need)
    if column.max_width is not None and column.max_width < column.min_width:
        column.max_width = None
    if column.overflow == "ellipsis":
        column.overflow = "fold"  # a last resort that keeps every character


def fitted(table: Table) -> Table:
    """``table`` with every column as wide as its header and its longest cell."""
    for column in table.columns:
        _fit_column(column)
    return table


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` fitted; lines wider than the terminal are left for it to wrap."""
    console.print(fitted(table), crop=False)
