"""Call a pool's replicas directly, past the ingress, as any program connected to the Ray
cluster can: what a replica answers a caller without the cluster's key.

Usage: ``python cluster_call.py SPEC`` with ``RAY_ADDRESS`` set; SPEC (JSON) is ``{"app": ...,
"pool": ..., "model": ..., "path": ..., "body": {...}, "authorizations": [header or null]}``.
Prints one JSON line: per authorization, the head the replica answered (status, replica) and
its body.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any


async def call(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from ray import serve

    handle = serve.get_deployment_handle(spec["pool"], app_name=spec["app"])
    handle = handle.options(multiplexed_model_id=spec["model"], stream=True)
    answers = []
    body = json.dumps(spec["body"]).encode()
    for authorization in spec["authorizations"]:
        items = [item async for item in handle.forward.remote(spec["path"], body, authorization)]
        head, rest = items[0], b"".join(items[1:])
        answers.append({"status": head["status"], "replica": head["replica"],
                        "body": json.loads(rest)})  # fmt: skip
    return answers


def main() -> None:
    import ray

    ray.init(logging_level="ERROR", log_to_driver=False)
    try:
        answers = asyncio.run(call(json.loads(sys.argv[1])))
    finally:
        ray.shutdown()
    sys.stdout.write(json.dumps(answers) + "\n")


if __name__ == "__main__":
    main()
