"""The pieces ``benchmarks/bench_pd.py`` adds to the benchmark helpers: a histogram read from a
``/metrics`` scrape and what grew between two scrapes, a quantile from its buckets, a batch of
prompts of seeded lengths, and the closed-loop client whose ``prepare`` step (a P/D router's
prefill request) is timed with the request and adds fields to its body."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from elastickv.bench.client import PrepareError, run_closed
from elastickv.bench.monitor import histogram
from elastickv.bench.stats import bucket_quantile
from elastickv.bench.workloads import TOKEN_RANGE, Arrival, batch

NAME = "vllm:nixl_xfer_time_seconds"


def scrape(counts: list[float], total: float) -> str:
    bounds = ["0.005", "0.01", "0.025", "+Inf"]
    lines = ["# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration"]
    for le, n in zip(bounds, counts, strict=True):
        lines.append(f'{NAME}_bucket{{engine="0",le="{le}",model_name="m"}} {n}')
    lines += [f'{NAME}_count{{engine="0",model_name="m"}} {counts[-1]}']
    lines += [f'{NAME}_sum{{engine="0",model_name="m"}} {total}']
    lines += ['vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 9.0']
    return "\n".join(lines)


def test_histogram_from_a_scrape_and_what_grew_since() -> None:
    before = histogram(scrape([1, 1, 2, 2], 0.02), NAME)
    after = histogram(scrape([5, 9, 10, 10], 0.09), NAME)
    assert after.count == 10 and after.sum == pytest.approx(0.09)
    assert after.buckets[-1] == (math.inf, 10)
    grown = after - before
    assert grown.count == 8 and grown.sum == pytest.approx(0.07)
    assert grown.buckets == ((0.005, 4), (0.01, 8), (0.025, 8), (math.inf, 8))
    assert histogram("", NAME).count == 0 and histogram("", NAME).buckets == ()


def test_bucket_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.005, 4.0), (0.01, 8.0), (math.inf, 8.0)]
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.005)
    assert bucket_quantile(buckets, 0.25) == pytest.approx(0.0025)
    assert bucket_quantile(buckets, 0.75) == pytest.approx(0.0075)
    assert bucket_quantile([(0.005, 1.0), (math.inf, 4.0)], 0.99) == 0.005  # in +Inf
    assert bucket_quantile([(0.005, 0.0), (math.inf, 0.0)], 0.5) is None
    assert bucket_quantile([], 0.5) is None


def test_batch_is_seeded_within_the_lengths() -> None:
    arrivals = batch("m", 20, prompt_tokens=(100, 300), max_tokens=7, seed=3)
    assert arrivals == batch("m", 20, prompt_tokens=(100, 300), max_tokens=7, seed=3)
    assert all(100 <= len(a.prompt) <= 300 and a.max_tokens == 7 for a in arrivals)
    assert all(TOKEN_RANGE[0] <= t < TOKEN_RANGE[1] for a in arrivals for t in a.prompt)
    assert len({len(a.prompt) for a in arrivals}) > 1


async def serve_completions(bodies: list[dict[str, Any]], in_flight: list[int]) -> web.AppRunner:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        response = web.StreamResponse()
        await response.prepare(request)
        await asyncio.sleep(0.01)
        for i in range(body["max_tokens"]):
            event = {"choices": [{"text": f"{body['prompt'][0]}.{i} "}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        in_flight[0] -= 1
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def test_run_closed_keeps_the_concurrency_and_times_the_prepare_step() -> None:
    bodies: list[dict[str, Any]] = []
    in_flight = [0, 0]
    arrivals = [Arrival(0.0, "m", (i, 5, 6), 3) for i in range(10)]

    async def prepare(session: aiohttp.ClientSession, arrival: Arrival) -> dict[str, Any]:
        await asyncio.sleep(0.05)
        if arrival.prompt[0] == 9:
            raise PrepareError("prefill HTTP 500")
        return {"kv_transfer_params": {"id": arrival.prompt[0]}}

    async def go() -> Any:
        runner = await serve_completions(bodies, in_flight)
        try:
            port = runner.addresses[0][1]
            return await run_closed(f"http://127.0.0.1:{port}", arrivals, 3, prepare=prepare)
        finally:
            await runner.cleanup()

    results, seconds = asyncio.run(go())
    assert in_flight[1] <= 3
    assert sorted(b["kv_transfer_params"]["id"] for b in bodies) == list(range(9))
    ok, failed = results[:9], results[9]
    assert all(r.ok and r.text == f"{i}.0 {i}.1 {i}.2 " for i, r in enumerate(ok))
    assert all(r.ttft is not None and r.ttft >= 0.05 for r in ok)  # the prepare step counts
    assert not failed.ok and failed.error == "PrepareError: prefill HTTP 500"
    assert seconds >= max(r.sent_at + r.e2e for r in results) - 1e-9
