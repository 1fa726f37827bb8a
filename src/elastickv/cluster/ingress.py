"""The cluster's one OpenAI endpoint: the ingress deployment behind Ray Serve's HTTP proxy.

``GET /v1/models`` lists every model the cluster serves; ``POST /v1/completions`` and ``POST
/v1/chat/completions`` go, by the body's ``model``, to that model's pool through Ray Serve's
model multiplexing (``handle.options(multiplexed_model_id=model)``): the pool's request router
(:mod:`elastickv.cluster.routing`) picks the replica that holds the model, or the one that
is to load it. Streamed or not, the replica's answer passes through unchanged, with two
headers saying which replica and node served it.

With a cluster key every route answers 401 unless the request carries it. A replica that dies
while serving a request (its node removed, its process killed) ends that request with a 502
(``"type": "replica_failed"``), or with an error event if its stream had started; Ray Serve
starts a replacement, and the model is loaded again where the router sends its next request.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ray.exceptions import RayError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from elastickv.cluster.config import ClusterModel, KeySource
from elastickv.serve.router import FORWARDED_PATHS

logger = logging.getLogger("ray.serve")
REPLICA_HEADER = "x-elastickv-replica"
NODE_HEADER = "x-elastickv-node"


def error(status: int, message: str, kind: str, **headers: str) -> JSONResponse:
    """An error in OpenAI's format."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers or None)


class ClusterIngress:
    """The ingress deployment class (see the module doc)."""

    def __init__(self, pools: Mapping[str, Any], models: Mapping[str, ClusterModel],
                 key: KeySource) -> None:  # fmt: skip
        self.pools = dict(pools)  # pool name -> its deployment's handle
        self.models = dict(models)
        self.key = key.load(os.environ)  # the cluster's key, read on this node
        self.created = int(time.time())

    async def __call__(self, request: Request) -> Response:
        if self.key is not None and not self.key.matches(request.headers.get("authorization")):
            return error(
                401,
                "missing or wrong API key: send it as the header 'Authorization: Bearer <key>'",
                "invalid_request_error",
                **{"WWW-Authenticate": "Bearer"},
            )
        path = request.url.path
        if request.method == "GET" and path == "/v1/models":
            return self.list_models()
        if request.method == "POST" and path in FORWARDED_PATHS:
            return await self.forward(request, path)
        return error(404, f"no route {request.method} {path}", "NotFoundError")

    def list_models(self) -> Response:
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": self.created,
                "owned_by": "elastickv",
                "root": m.config.source,
                "pool": m.pool,
                "replicas": m.copies,
            }
            for m in self.models.values()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return error(400, "the request body is not valid JSON", "invalid_request_error")
        name = payload.get("model") if isinstance(payload, dict) else None
        model = self.models.get(name) if isinstance(name, str) else None
        if model is None:
            served = ", ".join(self.models)
            if not isinstance(name, str):
                return error(
                    400, f"the request has no 'model' field; served models: {served}",
                    "invalid_request_error",
                )  # fmt: skip
            return error(
                404, f"The model `{name}` does not exist. Served models: {served}",
                "NotFoundError",
            )  # fmt: skip
        handle = self.pools[model.pool].options(multiplexed_model_id=model.name, stream=True)
        stream = handle.forward.remote(path, body, request.headers.get("authorization"))
        try:
            head = await stream.__anext__()
        except StopAsyncIteration:
            return error(502, f"the replica of model {name!r} answered nothing", "replica_failed")
        except RayError as exc:
            return self._replica_failed(model.name, exc)
        # The serve router's own date and server headers: the proxy sets its own.
        headers = {k: v for k, v in head["headers"] if k.lower() not in ("date", "server")}
        headers[REPLICA_HEADER], headers[NODE_HEADER] = head["replica"], head["node"]
        media = headers.pop("Content-Type", headers.pop("content-type", "application/json"))
        if media.startswith("text/event-stream"):
            return StreamingResponse(
                self._rest(stream, model.name), status_code=head["status"], headers=headers,
                media_type=media,
            )  # fmt: skip
        chunks = []
        try:
            async for chunk in stream:
                chunks.append(chunk)
        except RayError as exc:
            return self._replica_failed(model.name, exc)
        return Response(b"".join(chunks), status_code=head["status"], headers=headers,
                        media_type=media)  # fmt: skip

    async def _rest(self, stream: Any, name: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        except RayError as exc:
            logger.warning("elastickv: the replica of model %r failed mid-stream: %s", name,
                           exc.__class__.__name__)  # fmt: skip
            event = {
                "error": {
                    "message": f"the replica serving model {name!r} failed while streaming; "
                    "retry (the model is loaded again elsewhere)",
                    "type": "replica_failed",
                    "code": 502,
                }
            }
            yield f"data: {json.dumps(event)}\n\n".encode()

    def _replica_failed(self, name: str, exc: RayError) -> Response:
        logger.warning("elastickv: the replica of model %r failed: %s", name,
                       exc.__class__.__name__)  # fmt: skip
        return error(
            502,
            f"the replica serving model {name!r} failed ({exc.__class__.__name__}) while "
            "serving this request; retry (the model is loaded again elsewhere)",
            "replica_failed",
        )
