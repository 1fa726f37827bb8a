"""Fire a schedule of :class:`Arrival` s at an OpenAI endpoint and time every answer.

Each request is a streamed ``/v1/completions`` (token-id prompt, greedy, ``ignore_eos``), so
the client sees the first token arrive: TTFT, time per output token after it, end to end.
A request fails if the status is not 200, the stream carries an error event, or fewer tokens
than asked came back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from elastickv.bench.workloads import Arrival


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

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.tokens >= self.expected

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


async def _one(session: aiohttp.ClientSession, base: str, arrival: Arrival, start: float) -> Result:
    body = {
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
    try:
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
                usage = event.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens", 0))
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Result(arrival.model, sent - start, ttft, time.monotonic() - sent, tokens,
                      arrival.max_tokens, 0, f"{type(exc).__name__}: {exc}")  # fmt: skip
    return Result(arrival.model, sent - start, ttft, time.monotonic() - sent, tokens,
                  arrival.max_tokens, 200)  # fmt: skip


async def run_schedule(
    base: str, arrivals: Sequence[Arrival], timeout: float = 900
) -> list[Result]:
    """Send every arrival at its time (open loop: late answers never delay later sends)."""
    start = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0)
    timeouts = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeouts) as session:

        async def fire(arrival: Arrival) -> Result:
            await asyncio.sleep(max(0.0, start + arrival.at - time.monotonic()))
            return await _one(session, base, arrival, start)

        return list(await asyncio.gather(*(fire(a) for a in arrivals)))
