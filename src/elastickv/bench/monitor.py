"""Watch a running ``elastickv serve`` while load runs: each model's bytes and state from the
router's ``/health`` (every ``interval`` s), and each engine's own vLLM counters (preemptions,
waiting requests, seconds requests spent queued) from its ``/metrics`` (every fourth look).
The queue time is a counter, so it sees every wait, however short; the waiting gauge is only
sampled."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

READY_STATES = frozenset({"idle", "serving", "kv-released", "asleep", "stopped"})


def serve_ready(base: str) -> bool:
    """Whether the ``elastickv serve`` at ``base`` has started every model once (a model
    stopped since is ready too: its next request wakes it)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as response:
            models = json.loads(response.read())["data"]
    except (OSError, ValueError):
        return False
    return all(m["state"] in READY_STATES for m in models)


_METRIC = re.compile(
    r"^(vllm:num_preemptions_total|vllm:num_requests_waiting|vllm:request_queue_time_seconds_sum)"
    r"\{[^}]*\} (\S+)$"
)
_COUNTERS = {
    "vllm:num_preemptions_total": "preemptions",
    "vllm:request_queue_time_seconds_sum": "queue_s",
}


class Monitor:
    def __init__(self, base: str, models: Sequence[str], interval: float = 0.25) -> None:
        self.base = base
        self.interval = interval
        self.memory: list[tuple[float, dict[str, int]]] = []
        # Each engine's resident memory (PSS) as serve reads it (absent: no engine).
        self.resident: list[tuple[float, dict[str, int]]] = []
        self.latest: list[dict[str, Any]] = []
        self.states: dict[str, set[str]] = {m: set() for m in models}
        self.preemptions: dict[str, float] = dict.fromkeys(models, 0.0)
        self.max_waiting: dict[str, float] = dict.fromkeys(models, 0.0)
        self.queue_s: dict[str, float] = dict.fromkeys(models, 0.0)
        self._last: dict[tuple[str, int, str], float] = {}

    async def run(self, session: aiohttp.ClientSession, start: float) -> None:
        """Until cancelled. The first look at the engines is the baseline: an engine's
        counters are cumulative since it started, and an earlier workload's preemptions and
        queue time are not this one's."""
        tick = 0
        while True:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                async with session.get(self.base + "/health") as response:
                    models = (await response.json())["models"]
                self.latest = models
                sample = {m["name"]: m["committed_bytes"] or 0 for m in models}
                now = time.monotonic() - start
                self.memory.append((now, sample))
                resident = {
                    m["name"]: m["resident_bytes"] for m in models if m.get("resident_bytes")
                }
                self.resident.append((now, resident))
                for m in models:
                    self.states.setdefault(m["name"], set()).add(m["state"])
                if tick % 4 == 0:
                    await self._engines(session, models, baseline=tick == 0)
            tick += 1
            await asyncio.sleep(self.interval)

    async def _engines(
        self, session: aiohttp.ClientSession, models: list[dict[str, Any]], *, baseline: bool
    ) -> None:
        for m in models:
            if m["port"] is None:
                continue
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"http://127.0.0.1:{m['port']}/metrics") as response:
                    text = await response.text()
                self.absorb(m["name"], m["engine_pid"], text, baseline=baseline)

    def absorb(self, name: str, engine_pid: int, text: str, *, baseline: bool = False) -> None:
        """Take one scrape of an engine's ``/metrics``: the waiting gauge's peak, and what
        each counter grew since the last look at that engine process (a process seen for
        the first time counts from 0, unless this look is the ``baseline``)."""
        for line in text.splitlines():
            match = _METRIC.match(line)
            if not match:
                continue
            value = float(match.group(2))
            if match.group(1) == "vllm:num_requests_waiting":
                if not baseline:
                    self.max_waiting[name] = max(self.max_waiting.get(name, 0.0), value)
                continue
            counter = _COUNTERS[match.group(1)]
            key = (name, engine_pid, counter)
            if not baseline:
                grown = max(0.0, value - self._last.get(key, 0.0))
                totals: dict[str, float] = getattr(self, counter)
                totals[name] = totals.get(name, 0.0) + grown
            self._last[key] = value


@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram from a scrape, summed over its label sets: ``buckets`` are
    (upper bound, cumulative count), ascending, ``+Inf`` last."""

    sum: float = 0.0
    count: float = 0.0
    buckets: tuple[tuple[float, float], ...] = ()

    def __sub__(self, before: Histogram) -> Histogram:
        """What was observed since ``before`` (an earlier scrape of the same process)."""
        earlier = dict(before.buckets)
        return Histogram(
            self.sum - before.sum,
            self.count - before.count,
            tuple((le, n - earlier.get(le, 0.0)) for le, n in self.buckets),
        )


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$")
_LE = re.compile(r'(?:^|,)le="([^"]+)"')


def counter(text: str, name: str) -> float | None:
    """The sum of every sample of ``name`` in a ``/metrics`` text (None if absent)."""
    values = [
        float(m.group(3))
        for line in text.splitlines()
        if (m := _SAMPLE.match(line)) and m.group(1) == name
    ]
    return sum(values) if values else None


def histogram(text: str, name: str) -> Histogram:
    """The histogram ``name`` in a ``/metrics`` text (all zero if absent)."""
    total = count = 0.0
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        metric, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if metric == name + "_sum":
            total += value
        elif metric == name + "_count":
            count += value
        elif metric == name + "_bucket" and (le := _LE.search(labels)):
            bound = float(le.group(1))
            buckets[bound] = buckets.get(bound, 0.0) + value
    return Histogram(total, count, tuple(sorted(buckets.items())))


def machine_report(load_before: Sequence[float]) -> dict[str, Any]:
    """The machine a benchmark ran on: its CPUs and the load average before and after (a
    shared machine's numbers mean little without it)."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
