"""A Ray cluster on this machine for the Ray tests: ``ray.cluster_utils``' head node and added
nodes, each with a raylet of its own.

Usage: ``python ray_cluster.py [SPEC]``. ``SPEC`` (JSON) gives the nodes' arguments,
``{"head": {...}, "workers": [{...}, ...]}``; without it, the Ray executor test's cluster: a
head and one added node, each with one CPU and one "GPU". Once every node is up it prints
one JSON line (the GCS address to give a driver as ``RAY_ADDRESS``, and each node's id,
raylet pid and metrics export port), then serves, reading one command per line from stdin:

- ``remove NODE_ID``: the node is removed (its raylet and every process it started end, as
  when a host goes away); prints ``{"removed": NODE_ID}``;
- ``add ARGS``: a node with the JSON ``ARGS`` is added; prints its description.

When stdin is closed it shuts the cluster down and prints ``stopped``.

One GPU per node is what places vLLM's TP=2 workers on two nodes by construction: vLLM's
Ray executor asks for one bundle of one GPU per rank, and no node has two. The test starts
this script with the environment the workers need at process start (its platform shim on
``PYTHONPATH``, the /proc fd audit); the engine's ``ELASTICKV*`` settings are not here, they
reach the workers from the engine (vLLM hands the driver's environment to its Ray workers).
"""

from __future__ import annotations

import json
import sys
from typing import Any

NODE = {"num_cpus": 1, "num_gpus": 1}


def describe(node: Any, head: bool) -> dict[str, Any]:
    """A node's id, its raylet's pid (each Ray worker process is a child of its raylet) and
    the port of its metrics agent (Ray's Prometheus export)."""
    (raylet,) = node.all_processes["raylet"]
    return {
        "node_id": node.node_id,
        "raylet_pid": raylet.process.pid,
        "head": head,
        "metrics_export_port": node.metrics_export_port,
    }


def say(document: Any) -> None:
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


def main() -> None:
    from ray.cluster_utils import Cluster

    spec: dict[str, Any] = {"head": NODE, "workers": [NODE]}
    if len(sys.argv) > 1:
        spec = json.loads(sys.argv[1])
    head_args = {"include_dashboard": False, **spec["head"]}
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    try:
        added = {}
        for args in spec["workers"]:
            node = cluster.add_node(**args)
            added[node.node_id] = node
        cluster.wait_for_nodes()
        nodes = [describe(cluster.head_node, True)] + [describe(n, False) for n in added.values()]
        say({"address": cluster.address, "nodes": nodes})
        for line in sys.stdin:  # until the test closes it
            command, _, rest = line.strip().partition(" ")
            if command == "remove":
                cluster.remove_node(added.pop(rest))
                say({"removed": rest})
            elif command == "add":
                node = cluster.add_node(**json.loads(rest))
                cluster.wait_for_nodes()
                added[node.node_id] = node
                say(describe(node, False))
            else:
                say({"error": f"unknown command {line.strip()!r}"})
    finally:
        cluster.shutdown()
    sys.stdout.write("stopped\n")


if __name__ == "__main__":
    main()
