"""``elastickv list``: the instances registered on a device, their limits and use."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from elastickv.cli.ledger_view import (
    JSON_SCHEMA,
    add_device_argument,
    device_path,
    ledger_exists,
    limit_text,
    no_ledger_message,
    open_existing,
    snapshot_dict,
    user_errors,
)
from elastickv.cli.tables import output_console, print_table
from elastickv.control import DeviceUsage, LedgerSnapshot
from elastickv.serve.state_file import read_states
from elastickv.units import format_bytes


def register(commands: Any) -> None:
    p = commands.add_parser(
        "list",
        help="list the elastic instances on a device",
        description="List the instances registered in the device's ledger (dead ones are "
        "reclaimed first): limits desired and effective, revision, committed and reserved "
        "bytes, and the device budget and use.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_device_argument(p)
    p.set_defaults(run=run_list)


def run_list(args: argparse.Namespace) -> int:
    path = device_path(args.device)
    if not ledger_exists(path):
        if args.json:
            print(json.dumps({"schema": JSON_SCHEMA, "ledger": path, "exists": False}))
        else:
            print(no_ledger_message(args.device, path))
        return 0
    with open_existing(args.device) as ledger, user_errors():
        snap = ledger.snapshot()
    served = served_view(read_states(), snap) if args.device == "host" else []
    if args.json:
        print(json.dumps({"ledger": path, "exists": True, **snapshot_dict(snap), "serve": served}))
    else:
        render_list(snap, output_console(), served)
    return 0


def served_view(documents: Sequence[dict[str, Any]], snap: LedgerSnapshot) -> list[dict[str, Any]]:
    """The running serves' models with the bytes and limits of ``snap``: the same reading
    as the instance table (serve's file has what it last wrote, up to a moment old). A model
    without a record (stopped, or a native engine in static mode) keeps the file's figures."""
    records = {info.name: info for info in snap.instances}
    view = []
    for document in documents:
        models = []
        for model in document.get("models", []):
            info = records.get(model["name"])
            if info is not None:
                model = {
                    **model,
                    "committed_bytes": info.used_bytes,
                    "limit_bytes": info.limit_desired,
                    "over_limit_bytes": info.over_limit_bytes,
                }
            models.append(model)
        view.append({**document, "models": models})
    return view


def usage_line(usage: DeviceUsage) -> str:
    share = f"{usage.utilization:.0%} of {format_bytes(usage.total_bytes)}"
    if usage.headroom_bytes:
        share += f" minus {format_bytes(usage.headroom_bytes)} headroom"
    return (
        f"device {usage.device}: budget {format_bytes(usage.budget_bytes)} ({share}), "
        f"used {format_bytes(usage.used_bytes)} (committed {format_bytes(usage.committed_bytes)}"
        f" + reserved {format_bytes(usage.reserved_bytes)}), "
        f"available {format_bytes(usage.available_bytes)}, "
        f"{usage.instances}/{usage.capacity} instances"
    )


def render_list(
    snap: LedgerSnapshot, console: Console, served: Sequence[dict[str, Any]] = ()
) -> None:
    console.print(usage_line(snap.usage), highlight=False)
    states = {m["name"]: m["state"] for doc in served for m in doc.get("models", [])}
    if not snap.instances:
        console.print("no instances registered")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "PID", "LIMIT", "EFFECTIVE", "REV", "COMMITTED", "RESERVED", "STATE"):
        table.add_column(column, justify="left" if column in ("NAME", "STATE") else "right")
    for info in snap.instances:
        state = "alive" if info.alive else "dead"
        if info.name in states:
            state += f", {states[info.name]}"
        elif info.asleep:  # an engine put to sleep outside serve (the ledger API)
            state += ", asleep"
        if info.draining:
            state += f", draining {format_bytes(info.over_limit_bytes)}"
        table.add_row(
            info.name,
            str(info.pid),
            limit_text(info.limit_desired),
            format_bytes(info.limit_effective),
            str(info.limit_revision),
            format_bytes(info.committed_bytes),
            format_bytes(info.reserved_bytes),
            state,
        )
    print_table(console, table)
    for doc in served:
        render_served(doc, console)


def render_served(doc: dict[str, Any], console: Console) -> None:
    """One running ``elastickv serve``: its endpoint, budget and models (stopped ones too)."""
    console.print(
        f"elastickv serve (pid {doc['pid']}) at {doc['url']}/v1, KV budget "
        f"{format_bytes(doc['budget_bytes'])}",
        highlight=False,
    )
    table = Table(box=None, pad_edge=False)
    for column in ("MODEL", "STATE", "USED", "LIMIT", "MIN", "CAP", "IN-FLIGHT", "WAITING"):
        table.add_column(column, justify="left" if column in ("MODEL", "STATE") else "right")
    for m in doc.get("models", []):
        state = m["state"]
        if m.get("over_limit_bytes"):
            state += f", draining {format_bytes(m['over_limit_bytes'])}"
        table.add_row(
            m["name"],
            state,
            "-" if m["committed_bytes"] is None else format_bytes(m["committed_bytes"]),
            "-" if m["limit_bytes"] is None else format_bytes(m["limit_bytes"]),
            format_bytes(m["min_kv"]),
            format_bytes(m["cap"]),
            str(m["in_flight"]),
            str(m["waiting"]),
        )
    print_table(console, table)
