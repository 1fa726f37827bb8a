"""A two-node Ray cluster on this machine for the Ray executor test: ``ray.cluster_utils``'
head node and one added node, each with a raylet of its own, one CPU and one "GPU".

Usage: ``python ray_cluster.py``. Once both nodes are up it prints one JSON line (the GCS
address to give the engine as ``RAY_ADDRESS``, and each node's id and raylet pid), then
serves until its stdin is closed, shuts the cluster down and prints ``stopped``.

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
    """A node's id and its raylet's pid (each Ray worker process is a child of its raylet)."""
    (raylet,) = node.all_processes["raylet"]
    return {"node_id": node.node_id, "raylet_pid": raylet.process.pid, "head": head}


def main() -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        added = cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        nodes = [describe(cluster.head_node, True), describe(added, False)]
        sys.stdout.write(json.dumps({"address": cluster.address, "nodes": nodes}) + "\n")
        sys.stdout.flush()
        sys.stdin.read()  # until the test closes it
    finally:
        cluster.shutdown()
    sys.stdout.write("stopped\n")


if __name__ == "__main__":
    main()
