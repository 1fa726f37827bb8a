"""Entry point: ``elastickv <command>``; each command lives in its own module.

Only the module of the command being run is imported, so the control-plane commands
(``list``, ``limit``, ``top``, ``doctor``) start without loading torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from elastickv import __version__
from elastickv.cli.errors import UserError

# command -> (module that registers it, one-line help for the top-level listing)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("elastickv.cli.serve", "serve several models on one device behind one endpoint"),
    "cluster": (
        "elastickv.cli.cluster",
        "serve models over the devices of a Ray cluster behind one endpoint",
    ),
    "layout": ("elastickv.cli.layout", "inspect KV-cache layouts"),
    "models": ("elastickv.cli.models", "the built-in tiny models: shapes, paths, vLLM arguments"),
    "demo": ("elastickv.cli.demo", "serve the built-in models under a bursty load, live"),
    "list": ("elastickv.cli.instances", "list the elastic instances on a device"),
    "limit": ("elastickv.cli.limit", "set an instance's memory limit live"),
    "top": ("elastickv.cli.top", "live view of the instances on a device"),
    "doctor": ("elastickv.cli.doctor", "check what this machine supports and the ledger's health"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command`` (or every command, when None) gets its full sub-parser."""
    parser = argparse.ArgumentParser(
        prog="elastickv",
        description="Elastic, virtual-memory-backed KV cache for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"elastickv {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, summary) in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(module).register(commands)
        else:
            commands.add_parser(name, help=summary)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed as ``main`` parses it (only the chosen command's module is loaded);
    argparse exits with status 2 on a bad command line. The docs' command lines are checked
    with it."""
    args_in = list(argv)
    chosen = next((a for a in args_in if not a.startswith("-")), None)
    return build_parser(chosen if chosen in COMMANDS else None).parse_args(args_in)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if isinstance(getattr(args, "device", None), str):
            from elastickv.cli.ledger_view import device_key

            args.device = device_key(args.device)
        code: int = args.run(args)
        sys.stdout.flush()
    except UserError as err:
        print(f"elastickv: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader stopped reading (`| head`): it had what it wanted. Nothing more is
        # written, and the flush at exit must not fail on the closed pipe either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
