"""One frame of ``elastickv top``: per-instance bars and the device total, as rich renderables.

Kept apart from the terminal loop so a frame can be rendered (and tested) on its own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

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
    return text


# Cells the text columns take besides the name: figures, percentage, state, gaps.
TEXT_COLUMNS = 52


def bar_width(columns: int, name_width: int = 14) -> int:
    """Bars take what the names (shown whole) and the text columns leave of the width."""
    return max(4, min(48, columns - name_width - TEXT_COLUMNS))


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
    width = bar_width(columns, max((len(i.name) for i in snap.instances), default=4))
    usage = snap.usage
    device_line = Text.assemble(
        ("DEVICE ", "bold"),
        usage_bar(usage.committed_bytes, usage.reserved_bytes, usage.budget_bytes, width=width),
        f" {format_bytes(usage.used_bytes)} / {format_bytes(usage.budget_bytes)} budget"
        f" {_percent(usage.used_bytes, usage.budget_bytes).strip()}, {usage.instances} "
        f"instance{'s' if usage.instances != 1 else ''}",
    )
    table = Table(box=None, pad_edge=False)
    # The header sits over the figures, so a short bar does not widen its column.
    table.add_column("NAME", no_wrap=True)
    table.add_column("", no_wrap=True)
    table.add_column("USED / LIMIT", justify="right", no_wrap=True)
    table.add_column("", justify="right", no_wrap=True)
    table.add_column("STATE")
    for info in snap.instances:
        table.add_row(
            info.name,
            usage_bar(
                info.committed_bytes,
                info.reserved_bytes,
                info.limit_effective,
                width=width,
                over=info.draining,
            ),
            f"{format_bytes(info.used_bytes)} / {format_bytes(info.limit_effective)}",
            _percent(info.used_bytes, info.limit_effective),
            _instance_state(info, (served or {}).get(info.name)),
        )
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
