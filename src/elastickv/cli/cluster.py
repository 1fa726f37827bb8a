"""``elastickv cluster``: elastickv serve on every device of a Ray cluster, one endpoint."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from elastickv.cli.errors import UserError
from elastickv.units import format_bytes


def register(commands: Any) -> None:
    p = commands.add_parser(
        "cluster",
        help="serve models over the devices of a Ray cluster behind one OpenAI endpoint",
        description="Deploy a Ray Serve application on an existing Ray cluster: one replica per "
        "device, each running that device's elastickv serve, and one OpenAI endpoint that "
        "routes by `model` to the replica holding it (Ray Serve's model multiplexing). Runs "
        "until Ctrl-C, then removes the application. See docs/cluster.md.",
    )
    p.add_argument("--config", metavar="FILE", required=True, help="cluster TOML configuration")
    p.add_argument(
        "--address",
        help="the Ray cluster (e.g. auto, ray://head:10001; default: [ray] address, then "
        "RAY_ADDRESS)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the configuration, print the plan, start and connect to nothing",
    )
    p.set_defaults(run=run_cluster)


def _config(args: argparse.Namespace) -> Any:
    from elastickv.cluster.config import ClusterConfigError, load_cluster_config

    try:
        return load_cluster_config(args.config, environ=os.environ, address=args.address)
    except ClusterConfigError as exc:
        raise UserError(str(exc)) from None


def describe(config: Any) -> str:
    """The plan, one line per pool and model (never the key, only where it comes from)."""
    ingress = config.ingress
    key = ingress.key
    if key.required:
        who = f"API key from {key.file or 'ELASTICKV_API_KEY'} on every node"
    else:
        who = "no API key"
    lines = [
        f"ingress http://{ingress.host}:{ingress.port}/v1 (proxies: {ingress.proxy_location}; "
        f"{who}), Ray at {config.address or '(none given)'}, application {config.app_name!r}"
    ]
    for pool in config.pools:
        resources = ", ".join(f"{k}={v:g}" for k, v in pool.resources) or "none"
        lines.append(
            f"  pool {pool.name}: {pool.replicas} replicas (resources {resources}), up to "
            f"{pool.max_models} models each, KV budget {format_bytes(pool.budget)} each, page "
            f"{format_bytes(pool.page_size)}"
        )
        for m in config.models_of(pool.name):
            lines.append(
                f"    {m.name}: {m.config.source}  min_kv {format_bytes(m.config.min_kv)}  "
                f"held by {m.copies} replica{'s' if m.copies > 1 else ''} at most"
            )
    return "\n".join(lines)


def run_cluster(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.check:
        print(describe(config))
        return 0
    if config.address is None:
        raise UserError(
            "no Ray cluster given: start one (`ray start --head`) and pass --address auto, "
            "or set [ray] address or RAY_ADDRESS"
        )
    try:
        import ray.serve  # noqa: F401  (Ray Serve, with every module it imports)
    except ImportError as exc:
        raise UserError(
            f"Ray Serve cannot be imported in this Python ({exc.name or exc} is missing): "
            "install 'ray[serve]' next to vLLM and elastickv"
        ) from None
    from elastickv.cluster.app import deploy

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s elastickv cluster: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    log = logging.getLogger("elastickv.cluster")
    print(describe(config), file=sys.stderr, flush=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("stopping: removing the application (its replicas stop their engines)")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        deploy(config, stop, lambda url: log.info("serving %s at %s", _names(config), url))
    except (ConnectionError, RuntimeError) as exc:
        raise UserError(f"cannot deploy on the Ray cluster: {exc}") from None
    log.info("stopped: application %r removed", config.app_name)
    return 0


def _names(config: Any) -> str:
    return ", ".join(m.name for m in config.models)
