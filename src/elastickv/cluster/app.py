"""The Ray Serve application: one deployment per pool (its replicas, one per device, placed by
Ray's resources; each pool's handle routed by :class:`~elastickv.cluster.routing.PlacementRouter`)
and the ingress in front of them.

:func:`build` makes it from a checked configuration; :func:`app_builder` is the same for Ray
Serve's own config files (a KubeRay ``RayService``: ``import_path:
elastickv.cluster.app:app_builder`` with ``args: {config: /path/cluster.toml}``); :func:`deploy`
is what ``elastickv cluster`` runs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from elastickv.cluster.config import INGRESS_NAME, ClusterConfig, load_cluster_config

logger = logging.getLogger("elastickv.cluster")
# Long enough for a replica's serve to stop its engines (20 s each at most, in parallel).
GRACEFUL_SHUTDOWN_S = 120.0
INGRESS_MAX_ONGOING = 4096


def build(config: ClusterConfig) -> Any:
    """The application (Ray Serve's ``Application``) for ``config``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from elastickv.cluster.ingress import ClusterIngress
    from elastickv.cluster.replica import DeviceReplica
    from elastickv.cluster.routing import PlacementRouter

    pools = {}
    for pool in config.pools:
        models = {m.name: m for m in config.models_of(pool.name)}
        deployment = serve.deployment(
            DeviceReplica,
            name=pool.name,
            num_replicas=pool.replicas,
            max_ongoing_requests=pool.max_ongoing_requests,
            graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
            ray_actor_options={
                "num_cpus": pool.num_cpus,
                "num_gpus": pool.num_gpus,
                "resources": dict(pool.resources),
            },
            request_router_config=RequestRouterConfig(
                request_router_class=PlacementRouter,
                request_router_kwargs={"copies": {m.name: m.copies for m in models.values()}},
            ),
        )
        pools[pool.name] = deployment.bind(pool, models, config.ingress.key)
    ingress = serve.deployment(
        ClusterIngress,
        name=INGRESS_NAME,
        num_replicas=config.ingress.replicas,
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0, "resources": dict(config.ingress.resources)},
    )
    return ingress.bind(pools, {m.name: m for m in config.models}, config.ingress.key)


def app_builder(args: dict[str, str]) -> Any:
    """Ray Serve's application builder: ``args["config"]`` is the cluster configuration."""
    if "config" not in args:
        raise ValueError("elastickv's application needs args: {config: /path/to/cluster.toml}")
    return build(load_cluster_config(args["config"], environ=os.environ))


def deploy(config: ClusterConfig, stop: threading.Event, ready: Callable[[str], None]) -> None:
    """Connect to the Ray cluster, start Ray Serve's proxy on ``[ingress]``'s address, deploy
    the application and keep it until ``stop`` is set; then delete it (each replica's serve
    stops its engines), and Ray Serve too if no other application is left."""
    import ray
    from ray import serve

    ray.init(address=config.address, logging_level=logging.WARNING)
    try:
        serve.start(
            proxy_location=config.ingress.proxy_location,
            http_options={"host": config.ingress.host, "port": config.ingress.port},
        )
        try:
            serve.run(build(config), name=config.app_name, route_prefix="/")
            ready(f"http://{config.ingress.host}:{config.ingress.port}/v1")
            stop.wait()
        finally:
            serve.delete(config.app_name)
            if not serve.status().applications:
                serve.shutdown()
    finally:
        ray.shutdown()
