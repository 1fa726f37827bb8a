"""A replica's metrics, through Ray's Prometheus export (each node's metrics agent serves them
at its metrics export port, prefixed ``ray_``). Ray Serve labels them with the replica, the
deployment (the pool) and the application; each also has the model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve import metrics

LATENCY_BOUNDARIES = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


class ReplicaMetrics:
    """The metrics of one device replica."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "elastickv_cluster_requests",
            description="requests a replica answered, by model and HTTP status",
            tag_keys=("model", "status"),
        )
        self.ttft = metrics.Histogram(
            "elastickv_cluster_ttft_seconds",
            description="arrival at the replica to the first byte of the model's answer",
            boundaries=LATENCY_BOUNDARIES,
            tag_keys=("model",),
        )
        self.e2e = metrics.Histogram(
            "elastickv_cluster_e2e_seconds",
            description="arrival at the replica to the last byte of the answer",
            boundaries=LATENCY_BOUNDARIES,
            tag_keys=("model",),
        )
        self.loads = metrics.Counter(
            "elastickv_cluster_model_loads",
            description="models registered in the replica's serve (an engine started)",
            tag_keys=("model",),
        )
        self.load_seconds = metrics.Histogram(
            "elastickv_cluster_model_load_seconds",
            description="time from a model's first request on the replica to its engine healthy",
            boundaries=LATENCY_BOUNDARIES,
            tag_keys=("model",),
        )
        self.unloads = metrics.Counter(
            "elastickv_cluster_model_unloads",
            description="models the replica dropped (least recently used; engine stopped)",
            tag_keys=("model",),
        )
        self.loaded = metrics.Gauge(
            "elastickv_cluster_model_loaded",
            description="1 while the model is registered in the replica's serve",
            tag_keys=("model",),
        )
        self.committed = metrics.Gauge(
            "elastickv_cluster_kv_committed_bytes",
            description="KV bytes the model's engine holds on the replica's device",
            tag_keys=("model",),
        )
        self.limit = metrics.Gauge(
            "elastickv_cluster_kv_limit_bytes",
            description="the model's live KV limit set by the replica's arbiter",
            tag_keys=("model",),
        )
        self.budget = metrics.Gauge(
            "elastickv_cluster_kv_budget_bytes",
            description="the KV bytes the replica's models share",
        )

    def request(self, model: str, status: int) -> None:
        self.requests.inc(tags={"model": model, "status": str(status)})

    def observe(self, health: Mapping[str, Any], catalogue: list[str]) -> None:
        """Set the gauges from the replica's serve ``/health`` (every model of the pool, 0
        for those it does not hold)."""
        held = {m["name"]: m for m in health.get("models", [])}
        self.budget.set(float(health.get("budget_bytes") or 0))
        for name in catalogue:
            model = held.get(name)
            tags = {"model": name}
            self.loaded.set(1.0 if model is not None else 0.0, tags=tags)
            self.committed.set(float((model or {}).get("committed_bytes") or 0), tags=tags)
            self.limit.set(float((model or {}).get("limit_bytes") or 0), tags=tags)
