"""One frame of ``elastickv top``: per-instance bars and the device total, as rich renderables.

Kept apart from the terminal loop so a frame can be rendered (and tested) on its own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from elastickv.cli.ledger_view import limit_text
from elastickv.cli.tables import fitted
from elastickv.control import InstanceInfo, LedgerSnapshot
from elastickv.units import format_bytes

BAR_WIDTH = 32
COMMITTED = "█"
RESERVED = "▓"
FREE = "░"


def usage_bar(
    committed: int, reserved: int, total: int, *, width: int = BAR_WIDTH, over: bool = False
) -> Text:
    """``committed`` then ``reserved`` out of ``total`` as ``width`` cells; red when ``over``
    (an instance draining after a shrink)."""
    used = committed + reserved
    if total <= 0:  # nothing may be used: anything held shows as full
        cells_used = width if used else 0
        cells_committed = cells_used if committed else 0
    else:
        cells_used = min(width, round(width * used / total))
        cells_committed = min(cells_used, round(width * committed / total))
    cells_reserved = cells_used - cells_committed
    bar = Text()
    bar.append(COMMITTED * cells_committed, style="red" if over else "green")
    bar.append(RESERVED * cells_reserved, style="red" if over else "yellow")
    bar.append(FREE * (width - cells_committed - cells_reserved), style="bright_black")
    return bar


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:5.1f}%" if whole > 0 else "    -"


def _instance_state(info: InstanceInfo, served: str | None = None) -> Text:
    """The limit (or draining), and the model's state when ``elastickv serve`` runs it."""
    if info.draining:
        text = Text(f"draining {format_bytes(info.over_limit_bytes)}", style="bold red")
    else:
        text = Text(f"limit {limit_text(info.limit_desired)} r{info.limit_revision}")
    if served is not None:
        text.append(f" {served}", style="cyan")
    elif info.asleep:
        text.append(" asleep", style="cyan")
    return text


# The widest bar, and the narrowest worth showing: below it the frame has no bars.
MAX_BAR = 48
MIN_BAR = 4
# Cells between two columns of a table without a box: one cell of padding on each side.
COLUMN_GAP = 2
HEADERS = ("NAME", "", "USED / LIMIT", "", "STATE")


DEVICE_LABEL = "DEVICE "


def bar_width(columns: int, text_widths: Sequence[int], device_text: int) -> int:
    """The bars take what the text columns (``text_widths``, shown whole) and the gaps
    between all five columns leave of the width, and what the device line's label and
    figures (``device_text`` cells) leave of it: 0 (no bars) when that is less than
    ``MIN_BAR``, so no state or figure is ever cut."""
    table = columns - sum(text_widths) - COLUMN_GAP * len(text_widths)
    device = columns - len(DEVICE_LABEL) - 1 - device_text
    left = min(MAX_BAR, table, device)
    return left if left >= MIN_BAR else 0


def render_frame(
    snap: LedgerSnapshot | None,
    *,
    device: str,
    interval: float,
    problem: str | None = None,
    quit_hint: bool = True,
    columns: int = 80,
    served: Mapping[str, str] | None = None,
) -> RenderableType:
    """The whole screen: a title line, the device total, then one bar per instance, or the
    reason there is nothing to show (no ledger yet, a damaged ledger). ``served`` maps the
    names of models run by ``elastickv serve`` to their state (serving, kv-released, …)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(snap.taken_at if snap else time.time()))
    title = Text.assemble(
        ("elastickv top", "bold"),
        f"  device {device}  every {interval:g}s  {stamp}",
        ("  (q or Ctrl-C quits)" if quit_hint else "", "bright_black"),
    )
    if snap is None:
        return Group(title, Text(problem or "no ledger", style="yellow"))
    rows = [
        (
            info,
            f"{format_bytes(info.used_bytes)} / {format_bytes(info.limit_effective)}",
            _percent(info.used_bytes, info.limit_effective),
            _instance_state(info, (served or {}).get(info.name)),
        )
        for info in snap.instances
    ]
    text_widths = [
        max([len(HEADERS[0]), *(len(info.name) for info, *_ in rows)]),
        max([len(HEADERS[2]), *(len(figures) for _, figures, _, _ in rows)]),
        max([0, *(len(percent) for _, _, percent, _ in rows)]),
        max([len(HEADERS[4]), *(state.cell_len for *_, state in rows)]),
    ]
    usage = snap.usage
    device_text = (
        f"{format_bytes(usage.used_bytes)} / {format_bytes(usage.budget_bytes)} budget"
        f" {_percent(usage.used_bytes, usage.budget_bytes).strip()}, {usage.instances} "
        f"instance{'s' if usage.instances != 1 else ''}"
    )
    width = bar_width(columns, text_widths, len(device_text))
    device_line = Text.assemble(
        (DEVICE_LABEL, "bold"),
        usage_bar(usage.committed_bytes, usage.reserved_bytes, usage.budget_bytes, width=width),
        " " if width else "",
        device_text,
    )
    table = Table(box=None, pad_edge=False)
    # The header sits over the figures, so a short bar does not widen its column.
    table.add_column(HEADERS[0], no_wrap=True)
    if width:
        table.add_column(HEADERS[1], no_wrap=True)
    table.add_column(HEADERS[2], justify="right", no_wrap=True)
    table.add_column(HEADERS[3], justify="right", no_wrap=True)
    table.add_column(HEADERS[4], no_wrap=True)
    for info, figures, percent, state in rows:
        bar = usage_bar(
            info.committed_bytes,
            info.reserved_bytes,
            info.limit_effective,
            width=width,
            over=info.draining,
        )
        table.add_row(info.name, *([bar] if width else []), figures, percent, state)
    legend = Text.assemble(
        (COMMITTED, "green"),
        " committed  ",
        (RESERVED, "yellow"),
        " reserved  ",
        (FREE, "bright_black"),
        " free",
        style="bright_black",
    )
    parts: list[RenderableType] = [title, device_line]
    parts.append(
        fitted(table) if snap.instances else Text("no instances registered", style="yellow")
    )
    parts.append(legend)
    if problem:
        parts.append(Text(problem, style="red"))
    return Group(*parts)
