"""Entry point: ``elastickv <command>``; each command lives in its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from elastickv import __version__
from elastickv.cli import demo, doctor, instances, layout, limit, top
from elastickv.cli.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastickv",
        description="Elastic, virtual-memory-backed KV cache for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"elastickv {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    layout.register(commands)
    demo.register(commands)
    instances.register(commands)
    limit.register(commands)
    top.register(commands)
    doctor.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except UserError as err:
        print(f"elastickv: error: {err}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
