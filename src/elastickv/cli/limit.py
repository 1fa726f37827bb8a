"""``elastickv limit NAME SIZE|PCT%|none``: change an instance's limit live."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from elastickv.cli.errors import UserError
from elastickv.cli.ledger_view import (
    add_device_argument,
    instance_dict,
    limit_text,
    open_existing,
    user_errors,
)
from elastickv.control import parse_limit
from elastickv.units import format_bytes

NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def register(commands: Any) -> None:
    p = commands.add_parser(
        "limit",
        help="set an instance's memory limit live",
        description="Set the limit of a registered instance: a size (512M, 2G, 2GiB), a "
        "percentage of the device budget (30%), or 'none'. A shrink stops growth at once and "
        "drains lazily; raising the limit re-enables growth. Prints the new revision.",
    )
    p.add_argument("name", help="instance name (see `elastickv list`)")
    p.add_argument("limit", help="512M, 2G, 2GiB, 30%%, or none")
    p.add_argument(
        "--revision",
        type=int,
        metavar="N",
        help="apply only if the limit is still at revision N (else fail: someone changed it)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_device_argument(p)
    # argparse takes "-1G" for an unknown option and then reports the limit as missing; read
    # anything that starts like a negative number as the value, so parse_limit can say why
    # it is refused.
    p._negative_number_matcher = NEGATIVE_VALUE
    p.set_defaults(run=run_limit)


def run_limit(args: argparse.Namespace) -> int:
    try:
        parse_limit(args.limit, 100)  # the syntax, before touching the ledger
    except ValueError as err:
        raise UserError(str(err)) from None
    with open_existing(args.device) as ledger, user_errors():
        revision = ledger.set_limit(args.name, args.limit, expected_revision=args.revision)
        info = next((i for i in ledger.list_instances() if i.name == args.name), None)
    if args.json:
        payload: dict[str, Any] = {"name": args.name, "revision": revision}
        if info is not None:
            payload["instance"] = instance_dict(info)
        print(json.dumps(payload))
        return 0
    line = f"{args.name}: limit {args.limit.strip()} -> revision {revision}"
    if info is not None and info.limit_revision == revision:
        line += (
            f" (desired {limit_text(info.limit_desired)}, effective "
            f"{format_bytes(info.limit_effective)}"
        )
        if info.draining:
            line += f", draining {format_bytes(info.over_limit_bytes)}"
        line += ")"
    print(line)
    return 0
