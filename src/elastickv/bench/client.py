"""Fire a schedule of :class:`Arrival` s at an OpenAI endpoint and time every answer.

Each request is a streamed ``/v1/completions`` (token-id prompt, greedy, ``ignore_eos``), so
the client sees the first token arrive: TTFT, time per output token after it, end to end.
A request fails if the status is not 200, the stream carries an error event, or fewer tokens
than asked came back.

:func:`run_schedule` sends at fixed times (open loop); :func:`run_closed` keeps a fixed number
in flight (closed loop). A ``prepare`` step, awaited inside each request's timing, adds fields
to its body: a P/D router's prefill request, whose ``kv_transfer_params`` go to the decode
request, so TTFT counts from the prefill request to the decode engine's first token.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from elastickv.bench.workloads import Arrival

# Idle connections are dropped before a vLLM server (5 s keep-alive by default) closes them,
# so no request goes down a connection the server is closing at that instant.
KEEP_ALIVE_S = 2.0

Prepare = Callable[[aiohttp.ClientSession, Arrival], Awaitable[Mapping[str, Any]]]
"""Awaited before a request is sent, inside its timing: fields to add to its body."""


@dataclass(frozen=True)
class Result:
    model: str
    sent_at: float  # seconds from the schedule's start
    ttft: float | None
    e2e: float
    tokens: int
    expected: int
    status: int
    error: str | None = None
    text: str = ""  # the completion's text, streamed pieces joined

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.tokens >= self.expected

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


class PrepareError(RuntimeError):
    """A ``prepare`` step failed: the request fails with this message, unsent."""


async def _one(
    session: aiohttp.ClientSession,
    base: str,
    arrival: Arrival,
    start: float,
    prepare: Prepare | None = None,
) -> Result:
    body: dict[str, Any] = {
        "model": arrival.model,
        "prompt": list(arrival.prompt),
        "max_tokens": arrival.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    ttft = None
    tokens = 0
    pieces: list[str] = []
    try:
        if prepare is not None:
            body.update(await prepare(session, arrival))
        async with session.post(base + "/v1/completions", json=body) as response:
            if response.status != 200:
                text = await response.text()
                return Result(arrival.model, sent - start, None, time.monotonic() - sent, 0,
                              arrival.max_tokens, response.status, text[:300])  # fmt: skip
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(arrival.model, sent - start, ttft, time.monotonic() - sent,
                                  tokens, arrival.max_tokens, 200, str(event["error"]))  # fmt: skip
                if event.get("choices") and ttft is None:
                    ttft = time.monotonic() - sent
                pieces += [choice.get("text") or "" for choice in event.get("choices") or []]
                usage = event.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens", 0))
    except (TimeoutError, aiohttp.ClientError, PrepareError) as exc:
        return Result(arrival.model, sent - start, ttft, time.monotonic() - sent, tokens,
                      arrival.max_tokens, 0, f"{type(exc).__name__}: {exc}")  # fmt: skip
    return Result(arrival.model, sent - start, ttft, time.monotonic() - sent, tokens,
                  arrival.max_tokens, 200, text="".join(pieces))  # fmt: skip


async def run_schedule(
    base: str,
    arrivals: Sequence[Arrival],
    timeout: float = 900,
    *,
    headers: Mapping[str, str] | None = None,
) -> list[Result]:
    """Send every arrival at its time (open loop: late answers never delay later sends);
    ``headers`` go with every request (an endpoint's API key)."""
    start = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEP_ALIVE_S)
    timeouts = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeouts, headers=headers
    ) as session:

        async def fire(arrival: Arrival) -> Result:
            await asyncio.sleep(max(0.0, start + arrival.at - time.monotonic()))
            return await _one(session, base, arrival, start)

        return list(await asyncio.gather(*(fire(a) for a in arrivals)))


async def run_closed(
    base: str,
    arrivals: Sequence[Arrival],
    concurrency: int,
    *,
    prepare: Prepare | None = None,
    timeout: float = 900,
) -> tuple[list[Result], float]:
    """Send every arrival (their times ignored), ``concurrency`` in flight at once, each next
    one as soon as one finishes (closed loop); the results in ``arrivals`` order and the
    seconds from the first send to the last answer."""
    start = time.monotonic()
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEP_ALIVE_S)
    timeouts = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeouts) as session:

        async def fire(arrival: Arrival) -> Result:
            async with gate:
                return await _one(session, base, arrival, start, prepare)

        results = list(await asyncio.gather(*(fire(a) for a in arrivals)))
    return results, max((r.sent_at + r.e2e for r in results), default=0.0)
