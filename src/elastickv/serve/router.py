"""The one OpenAI endpoint in front of every served model (aiohttp).

Routes by the request's ``model`` field; a P/D model's requests go through the two-step
exchange of :mod:`elastickv.serve.pd`. An unknown model is an OpenAI-style 404 that lists
the served ones; a model that cannot take the request says why (429 with ``Retry-After``
while its wake queue is full, 503 when it failed); whatever the engine answers — status,
error body, a token stream — passes through unchanged. A client that disconnects cancels its
handler, which closes the upstream connection, and vLLM aborts the request. If the engine dies
mid-request the client gets a clean 502 (or, mid-stream, an error event before the stream
ends).

With an API key, every route answers 401 (OpenAI's error format) unless the request carries
``Authorization: Bearer <key>``. With the models API, ``POST /admin/models`` adds a model (a
``[[model]]`` table as JSON) and answers once its engine is healthy, and ``DELETE
/admin/models/{name}`` stops one and forgets it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from elastickv.serve.auth import ApiKey
from elastickv.serve.engine import ROUTER_KEEP_ALIVE_S
from elastickv.serve.metrics import CONTENT_TYPE, ServeMetrics
from elastickv.serve.model import ServedModel, Unavailable
from elastickv.serve.pd import PDPair, decode_request, prefill_request, transfer_params_of

logger = logging.getLogger("elastickv.serve")
FORWARDED_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
)


def upstream_session(keep_alive_s: float = ROUTER_KEEP_ALIVE_S) -> aiohttp.ClientSession:
    """The router's client to its engines. No connection cap: every request the router
    accepts gets its upstream connection at once (aiohttp's default pool of 100 queued the
    101st request inside the router, where no engine and no metric could see it); idle
    connections dropped after ``keep_alive_s``, shorter than the engines' own keep-alive
    (aiohttp's 15 s against vLLM's 5 s sent requests down connections the engine was
    closing); no total timeout (a long generation is not an error); bytes passed through as
    they come."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keep_alive_s),
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


class ModelsApiError(Exception):
    """A models API call refused: HTTP ``status`` and a message that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ModelsApi:
    """What the models API calls (wired by the app); both raise :class:`ModelsApiError`."""

    add: Callable[[Any], Awaitable[dict[str, Any]]]  # a [[model]] table -> its description
    remove: Callable[[str, float], Awaitable[dict[str, Any]]]  # (name, drain seconds)


DEFAULT_DRAIN_S = 60.0  # how long a removal waits for the model's requests in flight


def unauthorized() -> web.Response:
    """401 in OpenAI's error format (the key is never echoed)."""
    return error_response(
        401,
        "missing or wrong API key: send it as the header 'Authorization: Bearer <key>'",
        "invalid_request_error",
        headers={"WWW-Authenticate": "Bearer"},
    )


def require_key(key: ApiKey, refused: Callable[[], None]) -> Any:
    """aiohttp middleware: every route needs ``key`` (``refused`` counts each refusal)."""

    @web.middleware
    async def check(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not key.matches(request.headers.get("Authorization")):
            refused()
            return unauthorized()
        return await handler(request)

    return check


class Router:
    """The router's handlers over the served models."""

    def __init__(
        self,
        models: Mapping[str, ServedModel],
        metrics: ServeMetrics,
        session: aiohttp.ClientSession,
        describe: Callable[[], dict[str, Any]],
        pairs: Mapping[str, PDPair] | None = None,
        *,
        api_key: ApiKey | None = None,
        models_api: ModelsApi | None = None,
    ) -> None:
        self.models = {n: m for n, m in models.items() if m.config.group is None}
        self.pairs = dict(pairs or {})
        self.metrics = metrics
        self.session = session
        self.describe = describe
        self.api_key = api_key
        self.models_api = models_api
        self.created = int(time.time())

    def served_names(self) -> list[str]:
        return [*self.models, *self.pairs]

    def add(self, model: ServedModel) -> None:
        """Route requests to a model added at run time."""
        self.models[model.name] = model

    def remove(self, name: str) -> None:
        """Stop routing to a model (its new requests get the unknown-model 404)."""
        self.models.pop(name, None)

    def app(self) -> web.Application:
        middlewares = []
        if self.api_key is not None:
            middlewares.append(require_key(self.api_key, self.metrics.unauthorized.inc))
        app = web.Application(client_max_size=64 << 20, middlewares=middlewares)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        for path in FORWARDED_PATHS:
            app.router.add_post(path, self.forward)
        if self.models_api is not None:
            app.router.add_post("/admin/models", self.add_model)
            app.router.add_delete("/admin/models/{name:.+}", self.remove_model)
        return app

    async def add_model(self, request: web.Request) -> web.Response:
        assert self.models_api is not None
        try:
            raw = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            return error_response(
                400, "the request body is not valid JSON", "invalid_request_error"
            )
        try:
            described = await self.models_api.add(raw)
        except ModelsApiError as exc:
            return error_response(exc.status, exc.message, _kind(exc.status))
        return web.json_response({"model": described})

    async def remove_model(self, request: web.Request) -> web.Response:
        assert self.models_api is not None
        drain = request.query.get("drain", str(DEFAULT_DRAIN_S))
        try:
            drain_s = float(drain)
            if not 0 <= drain_s <= 3600:
                raise ValueError(drain)
        except ValueError:
            return error_response(
                400, f"drain = {drain!r}: seconds from 0 to 3600", "invalid_request_error",
                param="drain",
            )  # fmt: skip
        try:
            removed = await self.models_api.remove(request.match_info["name"], drain_s)
        except ModelsApiError as exc:
            return error_response(exc.status, exc.message, _kind(exc.status))
        return web.json_response(removed)

    async def list_models(self, request: web.Request) -> web.Response:
        data = [self._listing(m.name, m.config.source, m.state.value) for m in self.models.values()]
        for pair in self.pairs.values():
            entry = self._listing(pair.name, pair.decode.config.source, pair.state.value)
            entry["engines"] = {
                "prefill": pair.prefill.state.value,
                "decode": pair.decode.state.value,
            }
            data.append(entry)
        return web.json_response({"object": "list", "data": data})

    def _listing(self, name: str, source: str, state: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "elastickv",
            "root": source,
            "state": state,
        }

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
        pair = self.pairs.get(name)
        if model is None and pair is None:
            served = ", ".join(self.served_names())
            return error_response(
                404,
                f"The model `{name}` does not exist. Served models: {served}",
                "NotFoundError",
                param="model",
            )
        try:
            if pair is not None:
                response = await self._forward_pd(request, pair, payload, arrived)
            else:
                assert model is not None
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

    async def _forward_pd(
        self, request: web.Request, pair: PDPair, payload: dict[str, Any], arrived: float
    ) -> web.StreamResponse:
        """The two-step exchange (see :mod:`elastickv.serve.pd`). Each engine is held only
        for its own step; a prefill error goes back to the client as the engine gave it."""
        async with pair.prefill.serving() as queued:
            answer = await self._prefill(request, pair, payload)
        if isinstance(answer, web.StreamResponse):
            return answer
        body = json.dumps(decode_request(payload, answer)).encode()
        async with pair.decode.serving() as waited:
            self.metrics.queued.labels(pair.name).observe(queued + waited)
            return await self._proxy(request, pair.decode, body, arrived, label=pair.name)

    async def _prefill(
        self, request: web.Request, pair: PDPair, payload: dict[str, Any]
    ) -> dict[str, Any] | web.StreamResponse:
        """The prefill step: its answer's ``kv_transfer_params``, or the response that ends
        the request (the engine's own error, or a 502)."""
        url = pair.prefill.url
        if url is None:
            return self._engine_lost(pair.prefill, "has no engine")
        try:
            async with self.session.post(
                url + request.path, json=prefill_request(payload)
            ) as upstream:
                data = await upstream.read()
                status = upstream.status
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            return self._engine_lost(
                pair.prefill, f"closed the connection ({exc.__class__.__name__})"
            )
        if status != 200:
            return web.Response(status=status, body=data, content_type="application/json")
        try:
            params = transfer_params_of(json.loads(data))
        except ValueError:
            params = None
        if params is None:
            logger.warning("%s: the prefill engine answered without kv_transfer_params", pair.name)
            return error_response(
                502,
                f"the prefill engine of model {pair.name!r} answered without kv_transfer_params "
                "(is its KV connector NIXL?); see its log",
                "engine_failed",
            )
        return params

    async def _proxy(
        self,
        request: web.Request,
        model: ServedModel,
        body: bytes,
        arrived: float,
        *,
        label: str | None = None,
    ) -> web.StreamResponse:
        """Forward ``body`` to ``model``'s engine; metrics under ``label`` (default: the
        model's name)."""
        url = model.url
        name = label or model.name
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
                    return await self._stream(request, name, upstream, passed, arrived)
                data = await upstream.read()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            return self._engine_lost(model, f"closed the connection ({exc.__class__.__name__})")
        elapsed = time.monotonic() - arrived
        self.metrics.ttft.labels(name).observe(elapsed)
        self.metrics.e2e.labels(name).observe(elapsed)
        return web.Response(status=upstream.status, body=data, headers=passed)

    async def _stream(
        self,
        request: web.Request,
        name: str,
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
                    self.metrics.ttft.labels(name).observe(time.monotonic() - arrived)
                    first = False
                await response.write(chunk)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            logger.warning("%s: engine closed a stream mid-way (%s)", name, exc)
            event = {
                "error": {
                    "message": f"the engine of model {name!r} failed while streaming; "
                    "it is being restarted",
                    "type": "engine_failed",
                    "code": 502,
                }
            }
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        self.metrics.e2e.labels(name).observe(time.monotonic() - arrived)
        await response.write_eof()
        return response

    def _engine_lost(self, model: ServedModel, what: str) -> web.Response:
        if model.removed:
            return error_response(
                502,
                f"model {model.name!r} was removed from this server while serving this request",
                "model_removed",
            )
        logger.warning("%s: the engine %s during a request", model.name, what)
        return error_response(
            502,
            f"the engine of model {model.name!r} {what} while serving this request; it is being "
            "restarted, retry shortly",
            "engine_failed",
        )


def _kind(status: int) -> str:
    """OpenAI's error type for a models API status."""
    return {400: "invalid_request_error", 404: "NotFoundError", 409: "conflict"}.get(
        status, "service_unavailable" if status == 503 else "engine_failed"
    )
