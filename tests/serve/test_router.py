"""The router over real HTTP, with a small aiohttp app standing in for a vLLM engine (the
real engines are in tests/integration_vllm/test_vllm_plugin_v032_serve.py): routing by
``model``, errors in the OpenAI format, pass-through of upstream statuses and streams, a
client disconnect closing the upstream request, an engine that dies, the wake queue bound."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from elastickv.serve.auth import ApiKey
from elastickv.serve.config import ModelConfig
from elastickv.serve.engine import EngineLaunch
from elastickv.serve.metrics import ServeMetrics
from elastickv.serve.model import ModelHooks, ModelState, ServedModel
from elastickv.serve.pd import PREFILL_TRANSFER_PARAMS, PDPair
from elastickv.serve.router import ModelsApi, ModelsApiError, Router, upstream_session


class FakeEngine:
    """What the router reads of a running engine: its launch (URL)."""

    def __init__(self, port: int) -> None:
        self.launch = EngineLaunch("m", (), {}, port, Path("/dev/null"))
        self.pid = 0


@asynccontextmanager
async def site(app: web.Application) -> AsyncIterator[int]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    tcp = web.TCPSite(runner, "127.0.0.1", 0)
    await tcp.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def upstream_app(events: dict[str, Any]) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        events.setdefault("bodies", []).append(body)
        if body.get("max_tokens", 0) > 1000:
            return web.json_response({"error": {"message": "too long", "code": 400}}, status=400)
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(3):
                await response.write(
                    f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode()
                )
            await response.write(b"data: [DONE]\n\n")
            return response
        if body.get("prompt") == "gather":  # answers once every gathered request arrived
            events["gathered"] = events.get("gathered", 0) + 1
            if events["gathered"] >= events["gather_target"]:
                events["all_arrived"].set()
            # Against a hang only: a router holding requests back never lets all arrive.
            await asyncio.wait_for(events["all_arrived"].wait(), 120)
            return web.json_response({"choices": [{"text": "ok"}]})
        params = body.get("kv_transfer_params")
        if params is not None and params.get("do_remote_decode"):  # a P/D prefill step
            if body.get("prompt") == "no-params":
                return web.json_response({"choices": [{"text": "p"}]})
            if body.get("prompt") == "refused":
                return web.json_response({"error": {"message": "nope", "code": 400}}, status=400)
            answer = {"choices": [{"text": "p"}], "kv_transfer_params": {"remote_block_ids": [7]}}
            return web.json_response(answer)
        if params is not None and not body.get("stream"):  # a P/D decode step
            return web.json_response({"choices": [{"text": "d"}], "got": params})
        if body.get("prompt") == "slow":  # answers only if never cancelled
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                events["cancelled"] = True
                raise
        return web.json_response({"choices": [{"text": "ok"}]}, headers={"X-Upstream": "1"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    return app


def served(
    name: str, port: int | None, state: ModelState, queue_limit: int = 8, **config: Any
) -> ServedModel:
    async def nothing(_: str) -> None:
        return None

    hooks = ModelHooks(
        launch=lambda m: EngineLaunch(m.name, (), {}, 0, Path("/dev/null")),
        session=None,  # type: ignore[arg-type]
        changed=lambda: None,
        restore_kv=nothing,
        release_kv=nothing,
        engine_ready=nothing,
        woke=lambda *a: None,
        request_sleep=lambda *a: None,
        sleep_answer=lambda _: None,
    )
    model = ServedModel(
        ModelConfig(name=name, source="tiny-llama", **config), hooks, queue_limit=queue_limit,
        wake_timeout_s=0.5,
    )  # fmt: skip
    model.state = state
    if port is not None:
        model.engine = FakeEngine(port)  # type: ignore[assignment]
    return model


def run(
    test: Callable[[str, dict[str, Any], dict[str, ServedModel]], Awaitable[None]],
    *,
    api_key: ApiKey | None = None,
    models_api: ModelsApi | None = None,
) -> None:
    async def main() -> None:
        events: dict[str, Any] = {}
        async with site(upstream_app(events)) as upstream, upstream_session() as session:
            models = {
                "alpha": served("alpha", upstream, ModelState.IDLE),
                "dead": served("dead", 1, ModelState.IDLE),  # nothing listens on port 1
                "asleep": served("asleep", None, ModelState.STARTING, queue_limit=0),
            }
            for role in ("prefill", "decode"):  # a P/D model's engines, one fake for both
                models[f"pd/{role}"] = served(
                    f"pd/{role}", upstream, ModelState.IDLE, role=role, group="pd"
                )
            pairs = {"pd": PDPair("pd", models["pd/prefill"], models["pd/decode"])}
            metrics = ServeMetrics(lambda: (0, []))
            router = Router(
                models, metrics, session, lambda: {"models": []}, pairs, api_key=api_key,
                models_api=models_api,
            )  # fmt: skip
            async with site(router.app()) as port:
                await test(f"http://127.0.0.1:{port}", events, models)

    asyncio.run(main())


def test_routes_by_model_and_passes_answers_through() -> None:
    async def check(base: str, events: dict[str, Any], models: dict[str, ServedModel]) -> None:
        async with aiohttp.ClientSession() as client:
            async with client.post(
                base + "/v1/completions", json={"model": "alpha", "prompt": "x"}
            ) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["text"] == "ok"
                assert r.headers["X-Upstream"] == "1"
            async with client.post(
                base + "/v1/chat/completions", json={"model": "alpha", "max_tokens": 5000}
            ) as r:
                assert r.status == 400 and (await r.json())["error"]["message"] == "too long"
            async with client.post(
                base + "/v1/completions", json={"model": "alpha", "stream": True}
            ) as r:
                assert r.content_type == "text/event-stream"
                assert (await r.text()).count("data: ") == 4
            async with client.get(base + "/v1/models") as r:
                listed = {m["id"]: m["state"] for m in (await r.json())["data"]}
                assert listed == {
                    "alpha": "idle",
                    "dead": "idle",
                    "asleep": "starting",
                    "pd": "idle",
                }
            async with client.get(base + "/metrics") as r:
                text = await r.text()
                assert 'elastickv_router_ttft_seconds_count{model="alpha"} 3.0' in text
                assert 'elastickv_router_requests_total{model="alpha",status="400"} 1.0' in text
        assert models["alpha"].in_flight == 0 and models["alpha"].state is ModelState.IDLE

    run(check)


def test_errors_are_openai_shaped() -> None:
    async def check(base: str, events: dict[str, Any], models: dict[str, ServedModel]) -> None:
        async with aiohttp.ClientSession() as client:
            async with client.post(base + "/v1/completions", json={"model": "nope"}) as r:
                body = await r.json()
                assert r.status == 404 and body["error"]["param"] == "model"
                assert "alpha, dead, asleep, pd" in body["error"]["message"]
            # A P/D model's engines are reached through their pair only.
            async with client.post(base + "/v1/completions", json={"model": "pd/decode"}) as r:
                assert r.status == 404
            async with client.post(base + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            async with client.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                assert (
                    r.status == 400 and "no 'model' field" in (await r.json())["error"]["message"]
                )
            async with client.post(base + "/v1/completions", json={"model": "dead"}) as r:
                body = await r.json()
                assert r.status == 502 and body["error"]["type"] == "engine_failed"
            async with client.post(base + "/v1/completions", json={"model": "asleep"}) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
                assert "queue_limit 0" in (await r.json())["error"]["message"]

    run(check)


async def eventually(condition: Callable[[], bool], what: str, hang_s: float = 60.0) -> None:
    """Wait until ``condition()`` holds (the loop's other tasks make it so); ``hang_s`` only
    turns a hang into a failure naming ``what`` never happened."""
    deadline = asyncio.get_running_loop().time() + hang_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.01)


def test_client_disconnect_cancels_the_upstream_request() -> None:
    async def check(base: str, events: dict[str, Any], models: dict[str, ServedModel]) -> None:
        async with aiohttp.ClientSession() as client:
            request = asyncio.create_task(
                client.post(base + "/v1/completions", json={"model": "alpha", "prompt": "slow"})
            )
            await eventually(lambda: bool(events.get("bodies")), "the request reached the engine")
            assert models["alpha"].in_flight == 1
            request.cancel()
        await eventually(
            lambda: events.get("cancelled") is True and models["alpha"].in_flight == 0,
            "the engine's request was cancelled and the router counts none in flight",
        )

    run(check)


def test_a_waiting_request_times_out_with_503() -> None:
    async def check(base: str, events: dict[str, Any], models: dict[str, ServedModel]) -> None:
        models["asleep"].queue_limit = 4
        url = base + "/v1/completions"
        async with (
            aiohttp.ClientSession() as client,
            client.post(url, json={"model": "asleep"}) as r,
        ):
            body = await r.json()
        assert r.status == 503 and "did not become ready" in body["error"]["message"]
        assert models["asleep"].waiting == 0

    run(check)


def test_many_concurrent_requests_all_reach_the_engine() -> None:
    """More requests in flight than an HTTP client's default pool (100): every one reaches the
    engine at once; none waits inside the router."""

    async def check(base: str, events: dict[str, Any], models: dict[str, ServedModel]) -> None:
        events["gather_target"] = 150
        events["all_arrived"] = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as client:

            async def one() -> int:
                body = {"model": "alpha", "prompt": "gather"}
                async with client.post(base + "/v1/completions", json=body) as r:
                    return r.status

            statuses = await asyncio.gather(*(one() for _ in range(150)))
        assert statuses == [200] * 150

    run(check)


def test_a_pd_model_prefills_on_one_engine_and_decodes_on_the_other() -> None:
    async def check(base: str, events: dict[str, Any], models: dict[str, ServedModel]) -> None:
        url = base + "/v1/completions"
        request = {
            "model": "pd",
            "prompt": "x",
            "max_tokens": 9,
            "min_tokens": 3,
            "stream_options": {"include_usage": True},
        }
        async with aiohttp.ClientSession() as client:
            async with client.post(url, json=request) as r:
                assert r.status == 200
                answer = await r.json()
            # The decode engine got the prefill answer's transfer parameters.
            assert answer["got"] == {"remote_block_ids": [7]}
            first, second = events["bodies"]
            assert first == {
                "model": "pd",
                "prompt": "x",
                "max_tokens": 1,
                "kv_transfer_params": PREFILL_TRANSFER_PARAMS,
            }
            assert second == {**request, "kv_transfer_params": {"remote_block_ids": [7]}}
            # A stream: the prefill step is not streamed, the decode step is.
            async with client.post(url, json={**request, "stream": True}) as r:
                assert r.content_type == "text/event-stream"
                assert (await r.text()).count("data: ") == 4
            assert "stream" not in events["bodies"][2] and events["bodies"][3]["stream"]
            # The prefill engine's own error ends the request as it was.
            async with client.post(url, json={**request, "prompt": "refused"}) as r:
                assert r.status == 400 and (await r.json())["error"]["message"] == "nope"
            async with client.post(url, json={**request, "prompt": "no-params"}) as r:
                body = await r.json()
                assert r.status == 502 and "without kv_transfer_params" in body["error"]["message"]
            async with client.get(base + "/v1/models") as r:
                (pd,) = [m for m in (await r.json())["data"] if m["id"] == "pd"]
                assert pd["engines"] == {"prefill": "idle", "decode": "idle"}
            async with client.get(base + "/metrics") as r:
                text = await r.text()
                assert 'elastickv_router_ttft_seconds_count{model="pd"} 2.0' in text
                assert 'elastickv_router_requests_total{model="pd",status="502"} 1.0' in text
        assert models["pd/prefill"].in_flight == models["pd/decode"].in_flight == 0
        # A stopped engine of the pair: the pair reports it.
        models["pd/prefill"].state = ModelState.STOPPED
        assert PDPair("pd", models["pd/prefill"], models["pd/decode"]).state is ModelState.STOPPED

    run(check)


@asynccontextmanager
async def one_request_per_connection() -> AsyncIterator[tuple[int, list[int]]]:
    """An HTTP server that answers each connection's first request with keep-alive, then
    closes the connection, unanswered, when a second request arrives on it: an engine whose
    idle timer fires just as the client reuses the connection. Yields its port and the number
    of requests each connection saw."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(seen)
        seen.append(0)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen[index] += 1
                if seen[index] > 1:
                    break
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                body = b'{"choices": [{"text": "ok"}]}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        await server.wait_closed()


def test_an_idle_connection_is_not_reused_past_the_keep_alive() -> None:
    """An engine that closed a connection the router then reused was a 502 (aiohttp keeps
    idle connections 15 s, vLLM's server 5 s). The router drops an idle connection after its
    keep-alive, shorter than the engines' own (serve sets theirs), and opens a new one."""
    from elastickv.serve.engine import ENGINE_KEEP_ALIVE_S, ROUTER_KEEP_ALIVE_S

    assert ROUTER_KEEP_ALIVE_S < ENGINE_KEEP_ALIVE_S

    async def main() -> None:
        async with (
            one_request_per_connection() as (port, seen),
            upstream_session(keep_alive_s=0.2) as session,
        ):
            models = {"alpha": served("alpha", port, ModelState.IDLE)}
            router = Router(models, ServeMetrics(lambda: (0, [])), session, dict)
            async with site(router.app()) as base, aiohttp.ClientSession() as client:
                for _ in range(3):
                    async with client.post(
                        f"http://127.0.0.1:{base}/v1/completions", json={"model": "alpha"}
                    ) as r:
                        assert r.status == 200, await r.text()
                    await asyncio.sleep(0.3)  # idle past the router's keep-alive
        assert seen == [1, 1, 1]

    asyncio.run(main())


KEY = ApiKey("test", "s3cret-" + "k" * 25)
ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/health", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/completions", {"model": "alpha", "prompt": "x"}),
    ("POST", "/v1/chat/completions", {"model": "alpha", "messages": []}),
    ("POST", "/admin/models", {"name": "new", "model": "tiny-llama"}),
    ("DELETE", "/admin/models/alpha", None),
]


def test_with_a_key_every_route_needs_it() -> None:
    """401 in OpenAI's format without the key and with a wrong one, on every route (the
    models API's too); with it, the route answers; refusals are counted, the key is in no
    answer."""
    calls: list[Any] = []

    async def add(raw: Any) -> dict[str, Any]:
        calls.append(raw)
        return {"name": raw["name"]}

    async def remove(name: str, drain_s: float) -> dict[str, Any]:
        calls.append((name, drain_s))
        raise ModelsApiError(404, f"no model named {name!r}")

    async def check(base: str, events: dict[str, Any], models: dict[str, ServedModel]) -> None:
        wrong = ApiKey("test", "s3cret-" + "k" * 24 + "j")
        async with aiohttp.ClientSession() as client:
            for headers in ({}, wrong.header(), {"Authorization": KEY.secret}):
                for method, path, body in ROUTES:
                    async with client.request(method, base + path, json=body,
                                              headers=headers) as r:  # fmt: skip
                        assert r.status == 401, (method, path, headers)
                        assert r.headers["WWW-Authenticate"] == "Bearer"
                        error = (await r.json())["error"]
                        assert error["code"] == 401 and "Authorization: Bearer" in error["message"]
            assert calls == [] and events.get("bodies") is None  # nothing got through
            answers = []
            for method, path, body in ROUTES:
                async with client.request(method, base + path, json=body,
                                          headers=KEY.header()) as r:  # fmt: skip
                    answers.append((path, r.status))
                    assert KEY.secret not in await r.text()
            assert answers == [
                ("/v1/models", 200), ("/health", 200), ("/metrics", 200),
                ("/v1/completions", 200), ("/v1/chat/completions", 200),
                ("/admin/models", 200), ("/admin/models/alpha", 404),
            ]  # fmt: skip
            async with client.get(base + "/metrics", headers=KEY.header()) as r:
                assert "elastickv_router_unauthorized_total 21.0" in await r.text()
        assert calls == [{"name": "new", "model": "tiny-llama"}, ("alpha", 60.0)]

    run(check, api_key=KEY, models_api=ModelsApi(add, remove))


def test_the_models_api_answers_its_errors_in_openai_format() -> None:
    async def add(raw: Any) -> dict[str, Any]:
        raise ModelsApiError(409, "a model named 'alpha' is served already")

    async def remove(name: str, drain_s: float) -> dict[str, Any]:
        return {"removed": name, "drain": drain_s}

    async def check(base: str, events: dict[str, Any], models: dict[str, ServedModel]) -> None:
        async with aiohttp.ClientSession(headers=KEY.header()) as client:
            async with client.post(base + "/admin/models", json={"name": "alpha"}) as r:
                error = (await r.json())["error"]
                assert r.status == 409 and error["type"] == "conflict"
                assert error["message"] == "a model named 'alpha' is served already"
            async with client.post(base + "/admin/models", data=b"{") as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            async with client.delete(base + "/admin/models/a/b?drain=2.5") as r:
                assert (await r.json()) == {"removed": "a/b", "drain": 2.5}
            async with client.delete(base + "/admin/models/x?drain=-1") as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "drain"

    run(check, api_key=KEY, models_api=ModelsApi(add, remove))


def test_without_a_models_api_its_routes_do_not_exist() -> None:
    async def check(base: str, events: dict[str, Any], models: dict[str, ServedModel]) -> None:
        async with aiohttp.ClientSession() as client:
            async with client.post(base + "/admin/models", json={"name": "x"}) as r:
                assert r.status == 404
            async with client.delete(base + "/admin/models/alpha") as r:
                assert r.status == 404

    run(check)
