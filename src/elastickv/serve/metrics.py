"""The router's Prometheus metrics (``GET /metrics`` on the router's own port).

Measured by the router, per model: time to first token (first byte of the upstream answer),
end-to-end latency, time spent queued (waiting for a wake), wake latency by tier, requests
by outcome, engine restarts. Read at scrape time from the arbiter's last look at the ledger:
committed bytes and limit per model, ledger refusals, limit changes, the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class ModelReading:
    """One model as the scrape sees it."""

    name: str
    state: str
    in_flight: int
    waiting: int
    committed_bytes: int
    limit_bytes: int | None
    refusals: int
    restarts: int
    limit_raises: int
    limit_cuts: int
    resident_bytes: int | None = None  # the engine's PSS (None: no engine)


STATES = ("starting", "serving", "idle", "kv-released", "asleep", "stopped", "failed")


class _Readings(Collector):
    def __init__(self, read: Callable[[], tuple[int, Sequence[ModelReading]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        budget, models = self._read()
        yield GaugeMetricFamily(
            "elastickv_serve_budget_bytes", "KV bytes the served models share", value=budget
        )
        gauges = {
            "committed": GaugeMetricFamily(
                "elastickv_serve_committed_bytes",
                "KV bytes the model's engine holds (ledger: committed + reserved)",
                labels=["model"],
            ),
            "limit": GaugeMetricFamily(
                "elastickv_serve_limit_bytes",
                "the model's live ledger limit set by the arbiter",
                labels=["model"],
            ),
            "in_flight": GaugeMetricFamily(
                "elastickv_serve_in_flight", "requests being served", labels=["model"]
            ),
            "waiting": GaugeMetricFamily(
                "elastickv_serve_waiting", "requests queued while the model wakes", labels=["model"]
            ),
            "resident": GaugeMetricFamily(
                "elastickv_serve_engine_resident_bytes",
                "memory the model's engine processes hold (PSS; asleep: without its weights)",
                labels=["model"],
            ),
        }
        state = GaugeMetricFamily(
            "elastickv_serve_model_state",
            "1 for the model's current state",
            labels=["model", "state"],
        )
        counters = {
            "refusals": CounterMetricFamily(
                "elastickv_serve_refusals",
                "page commits the ledger refused the model's engine (it waited or preempted)",
                labels=["model"],
            ),
            "restarts": CounterMetricFamily(
                "elastickv_serve_engine_restarts", "engine crashes restarted", labels=["model"]
            ),
            "raises": CounterMetricFamily(
                "elastickv_serve_limit_raises", "arbiter raised the model's limit", labels=["model"]
            ),
            "cuts": CounterMetricFamily(
                "elastickv_serve_limit_cuts", "arbiter lowered the model's limit", labels=["model"]
            ),
        }
        for m in models:
            gauges["committed"].add_metric([m.name], m.committed_bytes)
            if m.limit_bytes is not None:
                gauges["limit"].add_metric([m.name], m.limit_bytes)
            gauges["in_flight"].add_metric([m.name], m.in_flight)
            gauges["waiting"].add_metric([m.name], m.waiting)
            if m.resident_bytes is not None:
                gauges["resident"].add_metric([m.name], m.resident_bytes)
            for s in STATES:
                state.add_metric([m.name, s], 1.0 if s == m.state else 0.0)
            counters["refusals"].add_metric([m.name], m.refusals)
            counters["restarts"].add_metric([m.name], m.restarts)
            counters["raises"].add_metric([m.name], m.limit_raises)
            counters["cuts"].add_metric([m.name], m.limit_cuts)
        yield from gauges.values()
        yield state
        yield from counters.values()


class ServeMetrics:
    """The router's registry (its own: never prometheus_client's global one)."""

    def __init__(self, read: Callable[[], tuple[int, Sequence[ModelReading]]]) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "elastickv_router_ttft_seconds",
            "request arrival to the first byte of the model's answer, as the router sees it",
            ["model"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "elastickv_router_e2e_seconds",
            "request arrival to the last byte of the answer",
            ["model"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.queued = Histogram(
            "elastickv_router_queue_seconds",
            "time a request waited for its model (a wake or start) before being forwarded",
            ["model"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.wake = Histogram(
            "elastickv_router_wake_seconds",
            "wake latency: tier kv (limit restored), weights (reloaded) or engine (started)",
            ["model", "tier"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.requests = Counter(
            "elastickv_router_requests",
            "requests by model and HTTP status",
            ["model", "status"], registry=self.registry,
        )  # fmt: skip
        self.unauthorized = Counter(
            "elastickv_router_unauthorized",
            "requests refused (401) for a missing or wrong API key",
            registry=self.registry,
        )
        self.registry.register(_Readings(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)
