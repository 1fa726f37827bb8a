"""``elastickv serve``: several models on one device behind one OpenAI endpoint."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from elastickv.cli.errors import UserError
from elastickv.units import format_bytes


def register(commands: Any) -> None:
    p = commands.add_parser(
        "serve",
        help="serve several models on one device, sharing its KV memory by demand",
        description="Start one vLLM OpenAI server per model (ELASTICKV=1), share a KV budget "
        "between them by demand, and route /v1/completions and /v1/chat/completions by the "
        "request's `model` behind one endpoint. Without --config or --model it serves two "
        "built-in tiny models. See docs/serve.md.",
    )
    p.add_argument("--config", metavar="FILE", help="TOML configuration (see docs/serve.md)")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]SOURCE",
        help="a model directory or built-in tiny model name to serve (repeat for several)",
    )
    p.add_argument("--budget", help="KV bytes all models share, e.g. 8G")
    p.add_argument("--min-kv", help="with --model: KV bytes guaranteed to each model")
    p.add_argument("--max-kv", help="with --model: most KV bytes one model may hold")
    p.add_argument(
        "--page-size",
        help="commit/release unit, e.g. 64K (default: 2M; 64K for the built-in models served "
        "without --config or --model)",
    )
    p.add_argument("--host", help="router address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="router port (default 8080)")
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="require this API key (the file's content) on every route, as 'Authorization: "
        "Bearer <key>'; or set ELASTICKV_API_KEY. Required with a --host beyond loopback",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="listen beyond loopback without an API key (anyone who reaches it may use it)",
    )
    p.add_argument(
        "--models-api",
        action="store_true",
        default=None,
        help="add and remove models at run time (POST /admin/models, DELETE "
        "/admin/models/NAME; needs an API key); without --config or --model: no models at start",
    )
    p.add_argument(
        "--exit-with-parent",
        type=int,
        metavar="PID",
        help="stop (as on SIGTERM) when process PID, the one that started serve, ends",
    )
    p.add_argument("--python", help="Python interpreter with vLLM and elastickv for the engines")
    p.add_argument("--log-dir", help="where engine logs go (default: a new temporary folder)")
    p.add_argument(
        "--check",
        action="store_true",
        help="make every check a start makes (configuration, engine Python, ledger, budget), "
        "print the plan, start nothing",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log arbiter decisions too")
    p.set_defaults(run=run_serve)


def _config(args: argparse.Namespace) -> Any:
    import os

    from elastickv.serve.config import (
        ServeConfigError,
        api_key_value,
        config_from_flags,
        load_config,
        page_size_value,
        size_value,
    )

    try:
        key = None
        if args.api_key_file is not None:
            key = api_key_value(args.api_key_file, "--api-key-file", None)
        overrides: dict[str, Any] = {
            "host": args.host,
            "port": args.port,
            "python": args.python,
            "log_dir": args.log_dir,
            "api_key": key,
            "allow_unauthenticated": args.allow_unauthenticated,
            "models_api": args.models_api,
            "budget": None if args.budget is None else size_value(args.budget, "--budget"),
            "page_size": (
                None if args.page_size is None else page_size_value(args.page_size, "--page-size")
            ),
        }
        if args.config:
            if args.model or args.min_kv or args.max_kv:
                raise UserError("--model, --min-kv and --max-kv cannot be combined with --config")
            return load_config(args.config, environ=os.environ, **overrides)
        return config_from_flags(
            args.model, min_kv=args.min_kv, max_kv=args.max_kv, environ=os.environ, **overrides
        )
    except ServeConfigError as exc:
        raise UserError(str(exc)) from None


def _describe(config: Any) -> str:
    from elastickv.serve.engine import engine_args

    lines = [
        f"router http://{config.host}:{config.port}/v1, KV budget {format_bytes(config.budget)}, "
        f"page {format_bytes(config.page_size)} ({config.source})"
    ]
    if config.api_key is not None:
        lines.append(f"  API key required on every route (from {config.api_key.source})")
    elif config.allow_unauthenticated:
        lines.append("  no API key: anyone who reaches the router may use it")
    if config.models_api:
        lines.append("  models API: POST /admin/models, DELETE /admin/models/NAME")
    for m in config.models:
        stop = "never" if m.pinned or m.stop_after_s is None else f"{m.stop_after_s:g}s"
        release = "never" if m.release_after_s is None else f"{m.release_after_s:g}s"
        sleep = "never" if m.sleep_after_s is None else f"{m.sleep_after_s:g}s"
        lines.append(
            f"  {m.name}: {m.source}  min_kv {format_bytes(m.min_kv)}  cap "
            f"{format_bytes(config.cap_of(m))}  priority {m.priority}  release after {release}"
            f"  sleep after {sleep}  stop after {stop}"
            + (f"  args {' '.join(engine_args(m))}" if engine_args(m) else "")
        )
    return "\n".join(lines)


def _warn_ignored_settings() -> None:
    import difflib
    import os

    from elastickv.integrations.vllm.config import KNOWN_VARIABLES
    from elastickv.serve.engine import PASSED_SETTINGS, SERVE_SETTINGS, ignored_settings

    for name in ignored_settings(os.environ):
        known = [*PASSED_SETTINGS, *SERVE_SETTINGS]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        if close:
            why = f"not a setting serve reads: did you mean {close[0]}?"
        elif name in KNOWN_VARIABLES or name == "ELASTICKV":
            why = "serve sets it for each engine from the configuration"
        else:
            close = difflib.get_close_matches(name, sorted(KNOWN_VARIABLES), n=1, cutoff=0.6)
            why = "not an elastickv setting" + (f": did you mean {close[0]}?" if close else "")
        print(f"elastickv serve: ignoring {name} from the environment ({why})", file=sys.stderr)


def run_serve(args: argparse.Namespace) -> int:
    if args.exit_with_parent is not None:
        from elastickv.serve.engine import exit_with_parent

        exit_with_parent(args.exit_with_parent)
    config = _config(args)
    _warn_ignored_settings()
    if args.check:
        from elastickv.serve.app import ServeApp, ServeError

        try:
            found = ServeApp(config).preflight()
        except ServeError as exc:
            raise UserError(str(exc)) from None
        print(_describe(config))
        print("\n".join(found))
        return 0
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s elastickv serve: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    print(_describe(config), file=sys.stderr, flush=True)
    from elastickv.serve.app import ServeApp, ServeError

    app = ServeApp(config)
    try:
        asyncio.run(_main(app))
    except ServeError as exc:
        raise UserError(str(exc)) from None
    finally:
        app.kill()  # whatever is left (an exception mid-start): nothing outlives serve
    return 0


async def _main(app: Any) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            app.kill()  # a second Ctrl-C: no more waiting
            sys.exit(130)
        logging.getLogger("elastickv.serve").info("stopping (again to kill at once)")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await app.run(stop)
