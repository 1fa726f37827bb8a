"""The one OpenAI endpoint in front of every served model (aiohttp).

Routes by the request's ``model`` field. An unknown model is an OpenAI-style 404 that lists
the served ones; a model that cannot take the request says why (429 with ``Retry-After``
while its wake queue is full, 503 when it failed); whatever the engine answers — status,
error body, a token stream — passes through unchanged. A client that disconnects cancels its
handler, which closes the upstream connection, and vLLM aborts the request. If the engine dies
mid-request the client gets a clean 502 (or, mid-stream, an error event before the stream
ends).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from elastickv.serve.metrics import CONTENT_TYPE, ServeMetrics
from elastickv.serve.model import ServedModel, Unavailable

logger = logging.getLogger("elastickv.serve")
FORWARDED_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
)


def upstream_session() -> aiohttp.ClientSession:
    """The router's client to its engines. No connection cap: every request the router
    accepts gets its upstream connection at once (aiohttp's default pool of 100 queued the
    101st request inside the router, where no engine and no metric could see it); no total
    timeout (a long generation is not an error); bytes passed through as they come."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        auto_decompress=False,
    )


def error_response(
    status: int, message: str, kind: str, *, param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:  # fmt: skip
    """An error in the OpenAI format (``{"error": {...}}``)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Router:
    """The router's handlers over the served models."""

    def __init__(
        self,
        models: Mapping[str, ServedModel],
        metrics: ServeMetrics,
        session: aiohttp.ClientSession,
        describe: Callable[[], dict[str, Any]],
    ) -> None:
        self.models = models
        self.metrics = metrics
        self.session = session
        self.describe = describe
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        for path in FORWARDED_PATHS:
            app.router.add_post(path, self.forward)
        return app

    async def list_models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": self.created,
                "owned_by": "elastickv",
                "root": m.config.source,
                "state": m.state.value,
            }
            for m in self.models.values()
        ]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.describe()})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            body = await request.read()
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return error_response(
                400, "the request body is not valid JSON", "invalid_request_error"
            )
        name = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(name, str):
            return error_response(
                400,
                f"the request has no 'model' field; served models: {', '.join(self.models)}",
                "invalid_request_error",
                param="model",
            )
        model = self.models.get(name)
        if model is None:
            return error_response(
                404,
                f"The model `{name}` does not exist. Served models: {', '.join(self.models)}",
                "NotFoundError",
                param="model",
            )
        try:
            async with model.serving() as queued:
                self.metrics.queued.labels(name).observe(queued)
                response = await self._proxy(request, model, body, arrived)
        except Unavailable as exc:
            headers = None
            if exc.retry_after is not None:
                headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
            self.metrics.requests.labels(name, str(exc.status)).inc()
            kind = "rate_limit_error" if exc.status == 429 else "service_unavailable"
            return error_response(exc.status, exc.message, kind, headers=headers)
        self.metrics.requests.labels(name, str(response.status)).inc()
        return response

    async def _proxy(
        self, request: web.Request, model: ServedModel, body: bytes, arrived: float
    ) -> web.StreamResponse:
        url = model.url
        if url is None:
            return self._engine_lost(model, "has no engine")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            async with self.session.post(
                url + request.path, data=body, headers=headers
            ) as upstream:
                passed = {
                    k: v
                    for k, v in upstream.headers.items()
                    if k.lower() not in _HOP_HEADERS and k.lower() != "content-encoding"
                }
                if upstream.content_type == "text/event-stream":
                    return await self._stream(request, model, upstream, passed, arrived)
                data = await upstream.read()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            return self._engine_lost(model, f"closed the connection ({exc.__class__.__name__})")
        elapsed = time.monotonic() - arrived
        self.metrics.ttft.labels(model.name).observe(elapsed)
        self.metrics.e2e.labels(model.name).observe(elapsed)
        return web.Response(status=upstream.status, body=data, headers=passed)

    async def _stream(
        self,
        request: web.Request,
        model: ServedModel,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        arrived: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        first = True
        try:
            async for chunk in upstream.content.iter_any():
                if first:
                    self.metrics.ttft.labels(model.name).observe(time.monotonic() - arrived)
                    first = False
                await response.write(chunk)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            logger.warning("%s: engine closed a stream mid-way (%s)", model.name, exc)
            event = {
                "error": {
                    "message": f"the engine of model {model.name!r} failed while streaming; "
                    "it is being restarted",
                    "type": "engine_failed",
                    "code": 502,
                }
            }
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        self.metrics.e2e.labels(model.name).observe(time.monotonic() - arrived)
        await response.write_eof()
        return response

    def _engine_lost(self, model: ServedModel, what: str) -> web.Response:
        logger.warning("%s: the engine %s during a request", model.name, what)
        return error_response(
            502,
            f"the engine of model {model.name!r} {what} while serving this request; it is being "
            "restarted, retry shortly",
            "engine_failed",
        )
