"""``elastickv doctor``: what this machine supports, and the ledger recovery command.

Exit status: 0 when the device's ledger is healthy (or not created yet), 1 when it is not (the
report says why and how to recover), 2 for bad input or a refused reset.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape

from elastickv.cli.diagnose import diagnose
from elastickv.cli.errors import UserError
from elastickv.cli.ledger_view import add_device_argument, device_path, user_errors
from elastickv.cli.tables import output_console
from elastickv.control import Ledger, LedgerError, reset_ledger
from elastickv.units import format_bytes


def register(commands: Any) -> None:
    p = commands.add_parser(
        "doctor",
        help="check what this machine supports and the ledger's health",
        description="Report the VMM backends (host, CUDA), the default page size and strict "
        "mode, the device ledger's location and health, and the installed vLLM with the "
        "contract it gets. --reset-ledger recreates a damaged ledger.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--reset-ledger",
        action="store_true",
        help="recreate the device's ledger (drops every record; stop its instances first)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --reset-ledger: reset even though live instances are registered",
    )
    add_device_argument(p)
    p.set_defaults(run=run_doctor)


def _live_instances(device: str) -> list[str]:
    """Names of live instances in a readable ledger; empty if it is missing or unreadable."""
    try:
        with Ledger.open(device, create=False) as ledger:
            return [info.name for info in ledger.list_instances()]
    except LedgerError:
        return []


def reset(device: str, *, force: bool) -> dict[str, Any]:
    path = device_path(device)
    live = _live_instances(device)
    if live and not force:
        raise UserError(
            f"ledger {path} is healthy and {len(live)} live instance(s) use it "
            f"({', '.join(live)}); resetting would unregister them. Stop them first, or pass "
            "--force"
        )
    with user_errors():
        reset_ledger(device)
    return {"path": path, "done": True, "dropped_instances": live}


def run_doctor(args: argparse.Namespace) -> int:
    if args.force and not args.reset_ledger:
        raise UserError("--force only applies to --reset-ledger")
    device_path(args.device)
    reset_report = reset(args.device, force=args.force) if args.reset_ledger else None
    report = diagnose(args.device)
    if reset_report is not None:
        report["reset"] = reset_report
    if args.json:
        print(json.dumps(report))
    else:
        render_doctor(report, output_console(highlight=False))
    return 0 if report["ledger"]["healthy"] else 1


def _backend_lines(report: dict[str, Any]) -> list[str]:
    host = report["backends"]["host"]
    cuda = report["backends"]["cuda"]
    lines = []
    if host["available"]:
        lines.append(
            f"  host   [green]available[/]: granularity {format_bytes(host['granularity'])}, "
            f"{'strict' if host['strict'] else 'non-strict'} by default"
        )
    else:
        lines.append(f"  host   [red]unavailable[/]: {escape(str(host['error']))}")
    bindings = (
        f"cuda-bindings {cuda['bindings_version']}"
        if cuda["bindings_installed"]
        else "cuda-bindings not installed"
    )
    if cuda["available"]:
        lines.append(
            f"  cuda   [green]available[/] (device {cuda['device']}, {bindings}): granularity "
            f"{format_bytes(cuda['granularity'])}, {format_bytes(cuda['total_bytes'])}, "
            "uncommitted pages "
            f"{'fault' if cuda['strict'] else 'read zeros (a shared zero page)'} by default"
        )
    else:
        lines.append(f"  cuda   [yellow]unavailable[/] ({bindings}): {escape(str(cuda['error']))}")
    return lines


def _ledger_lines(ledger: dict[str, Any]) -> list[str]:
    lines = [f"  path   {escape(ledger['path'])}"]
    if not ledger["healthy"]:
        lines.append(f"  status [red]unhealthy[/]: {escape(str(ledger['error']))}")
        if ledger["recovery"]:
            lines.append(f"  fix    {ledger['recovery']}")
    elif not ledger["exists"]:
        lines.append("  status [green]ok[/]: not created yet (the first instance creates it)")
    else:
        usage = ledger["usage"]
        lines.append(
            f"  status [green]healthy[/]: {usage['instances']} instance(s), budget "
            f"{format_bytes(usage['budget_bytes'])}, used {format_bytes(usage['used_bytes'])}"
        )
    return lines


def render_doctor(report: dict[str, Any], console: Console) -> None:
    console.print(
        f"elastickv {report['elastickv']} (Python {report['python']}, {report['platform']})"
    )
    console.print("backends")
    for line in _backend_lines(report):
        console.print(line)
    console.print(
        f"  default page size {format_bytes(report['default_page_size'])}, strict mode "
        f"{'on' if report['strict_default'] else 'off'} by default"
    )
    if "reset" in report:
        console.print(f"ledger reset: {escape(report['reset']['path'])}")
    console.print(f"ledger (device {report['ledger']['device']})")
    for line in _ledger_lines(report["ledger"]):
        console.print(line)
    console.print("vllm")
    for line in vllm_lines(report["vllm"]):
        console.print(line)


def vllm_lines(vllm: dict[str, Any]) -> list[str]:
    if not vllm["installed"]:
        return ["  [yellow]not installed[/]", f"  fix    {escape(vllm['hint'])}"]
    contract = vllm["contract"]
    verdict = f"the {contract} contract" if contract != "unsupported" else "[red]unsupported[/]"
    where = "this Python" if vllm["source"] == "this interpreter" else "project environment"
    lines = [
        f"  {vllm['distribution']} {vllm['version']}: {verdict}",
        f"  python {escape(vllm['python'])} ({where})",
        f"  plugin {'[green]installed[/]' if vllm['plugin'] else '[red]not installed[/]'}",
    ]
    for env in vllm["environments"]:
        if env["installed"] and env["python"] != vllm["python"]:
            lines.append(
                f"  also   {env['distribution']} {env['version']} in {escape(env['python'])}"
            )
    if vllm["hint"]:
        lines.append(f"  fix    {escape(vllm['hint'])}")
    return lines
