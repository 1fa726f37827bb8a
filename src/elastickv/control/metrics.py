"""Prometheus metrics of one elastic instance, served on an opt-in local port.

    metrics = InstanceMetrics(handle)
    allocator = BlockAllocator(geometry, vrange, metrics.metered_policy(LedgerPolicy(handle)))
    metrics.attach_allocator(allocator)
    with start_metrics_server(9400, metrics=metrics):
        blocks = metrics.allocate(allocator, 4)   # timed when it commits pages

Gauges and counters are read from the ledger record and the allocator at scrape time (a
collector, so nothing goes stale and nothing polls); only the commit-latency histogram is
recorded as commits happen. Each ``InstanceMetrics`` has its own registry: several instances
in one process never collide, and nothing lands in prometheus_client's global registry.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Self
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elastickv.alloc.policy import CapacityPolicy
from elastickv.control.errors import LedgerError
from elastickv.control.ledger import InstanceHandle

if TYPE_CHECKING:
    from elastickv.alloc import BlockAllocator

ENV_METRICS_PORT = "ELASTICKV_METRICS_PORT"
DEFAULT_HOST = "127.0.0.1"
LABELS = ("instance_name", "device")
# Commits cost microseconds (host, a warm CUDA handle pool) up to tens of milliseconds (a cold
# CUDA commit of many pages, an admission that waits on the ledger lock).
COMMIT_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
)  # fmt: skip


def metrics_port_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The opt-in port from ``ELASTICKV_METRICS_PORT`` (unset or empty: no endpoint)."""
    text = (os.environ if env is None else env).get(ENV_METRICS_PORT, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ValueError(f"{ENV_METRICS_PORT}={text!r} is not a TCP port number (0-65535)")
    return int(text)


class InstanceMetrics:
    """The metrics of one instance (its ledger record, optionally its allocator), in a
    registry of its own. ``name`` and ``device`` default to the handle's."""

    def __init__(
        self,
        handle: InstanceHandle | None = None,
        *,
        allocator: BlockAllocator | None = None,
        name: str | None = None,
        device: str | None = None,
        registry: CollectorRegistry | None = None,
        buckets: Iterable[float] = COMMIT_BUCKETS,
    ) -> None:
        if handle is None and name is None:
            raise ValueError("InstanceMetrics needs a ledger handle or an instance name")
        self._handle = handle
        self._allocator = allocator
        self._cached_blocks: Callable[[], int] | None = None
        self.name = name if name is not None else handle.name if handle is not None else ""
        self.device = device if device is not None else _device_of(handle)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._pending = threading.local()
        self._commit_seconds = Histogram(
            "elastickv_commit_seconds",
            "Seconds from admitting a page commit in the ledger to the end of the allocator "
            "call that committed it (or as timed by the allocator's owner)",
            LABELS,
            registry=self.registry,
            buckets=tuple(buckets),
        ).labels(self.name, self.device)
        self.registry.register(_InstanceCollector(self))

    @property
    def handle(self) -> InstanceHandle | None:
        return self._handle

    @property
    def allocator(self) -> BlockAllocator | None:
        return self._allocator

    def attach_allocator(
        self, allocator: BlockAllocator, *, cached_blocks: Callable[[], int] | None = None
    ) -> None:
        """Export this allocator's counters too (the allocator is usually built after the
        metrics, around :meth:`metered_policy`). ``cached_blocks`` counts the backed blocks
        no request uses but a prefix cache keeps for reuse (vLLM's block pool knows them)."""
        self._allocator = allocator
        self._cached_blocks = cached_blocks

    def cached_blocks(self) -> int:
        """Backed blocks kept only for prefix-cache reuse (0 when nobody said)."""
        return 0 if self._cached_blocks is None else self._cached_blocks()

    # -- commit latency ------------------------------------------------------------------------

    def observe_commit(self, seconds: float) -> None:
        """Record one commit's latency, for owners that time commits themselves."""
        self._commit_seconds.observe(seconds)

    @contextlib.contextmanager
    def time_commit(self) -> Iterator[None]:
        """Time the block as one commit (recorded even if it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe_commit(time.perf_counter() - start)

    def metered_policy(self, policy: CapacityPolicy) -> MeteredPolicy:
        """``policy`` with admissions stamped, so :meth:`allocate` and :meth:`precommit` can
        tell a call that committed pages from one served by pages already committed."""
        return MeteredPolicy(policy, self._pending)

    def allocate(self, allocator: BlockAllocator, n: int) -> list[int] | None:
        """``allocator.allocate(n)``; if it committed pages, records admission + commit time."""
        self._pending.start = None
        try:
            return allocator.allocate(n)
        finally:
            self._finish_commit()

    def precommit(self, allocator: BlockAllocator) -> int:
        """``allocator.precommit()`` (refilling the hot reserve), timed like :meth:`allocate`."""
        self._pending.start = None
        try:
            return allocator.precommit()
        finally:
            self._finish_commit()

    def _finish_commit(self) -> None:
        start: float | None = getattr(self._pending, "start", None)
        if start is not None:
            self._pending.start = None
            self.observe_commit(time.perf_counter() - start)


class MeteredPolicy(CapacityPolicy):
    """A capacity policy that marks when an admission granted bytes (the allocator commits
    right after), in the calling thread; everything else goes to the wrapped policy."""

    def __init__(self, inner: CapacityPolicy, pending: threading.local) -> None:
        self._inner = inner
        self._pending = pending

    @property
    def inner(self) -> CapacityPolicy:
        return self._inner

    def try_admit(self, nbytes: int) -> bool:
        start = time.perf_counter()
        admitted = self._inner.try_admit(nbytes)
        if admitted and getattr(self._pending, "start", None) is None:
            self._pending.start = start
        return admitted

    def release(self, nbytes: int) -> None:
        self._inner.release(nbytes)

    @property
    def admitted_bytes(self) -> int:
        return self._inner.admitted_bytes

    def available_bytes(self) -> int:
        return self._inner.available_bytes()


def _device_of(handle: InstanceHandle | None) -> str:
    return "" if handle is None else handle.ledger.device


class _InstanceCollector(Collector):
    """Reads the ledger record and allocator stats on every scrape."""

    def __init__(self, metrics: InstanceMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        metrics = self._metrics
        labels = [metrics.name, metrics.device]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        out: list[Metric] = []
        handle = metrics.handle
        if handle is not None:
            try:
                info = None if handle.closed else handle.info()
                usage = None if info is None else handle.ledger.device_usage()
            except LedgerError:
                info = usage = None
            out.append(
                gauge(
                    "elastickv_registered",
                    "1 while the instance is registered in the device ledger",
                    0 if info is None else 1,
                )
            )
            if info is not None and usage is not None:
                out += [
                    gauge(
                        "elastickv_committed_bytes",
                        "Committed bytes in the ledger",
                        info.committed_bytes,
                    ),
                    gauge(
                        "elastickv_reserved_bytes",
                        "Reserved (hot) bytes in the ledger",
                        info.reserved_bytes,
                    ),
                    gauge(
                        "elastickv_limit_bytes",
                        "Effective limit: the ceiling in force now",
                        info.limit_effective,
                    ),
                    gauge(
                        "elastickv_limit_desired_bytes",
                        "Limit the operator asked for (-1: none)",
                        -1 if info.limit_desired is None else info.limit_desired,
                    ),
                    gauge("elastickv_limit_revision", "Revision of the limit", info.limit_revision),
                    gauge(
                        "elastickv_over_limit_bytes",
                        "Bytes still to release after a limit shrink (draining while > 0)",
                        info.over_limit_bytes,
                    ),
                    gauge("elastickv_peak_bytes", "Peak committed + reserved", info.peak_bytes),
                    counter(
                        "elastickv_ledger_admissions",
                        "Commits the ledger admitted",
                        info.admissions,
                    ),
                    counter(
                        "elastickv_ledger_refusals",
                        "Commits the ledger refused (over the limit or the device budget)",
                        info.refusals,
                    ),
                    counter("elastickv_ledger_releases", "Releases to the ledger", info.releases),
                    gauge(
                        "elastickv_device_budget_bytes",
                        "Device budget shared by all instances",
                        usage.budget_bytes,
                    ),
                    gauge(
                        "elastickv_device_used_bytes",
                        "Committed + reserved bytes of all instances on the device",
                        usage.used_bytes,
                    ),
                ]
        allocator = metrics.allocator
        if allocator is not None:
            stats = allocator.stats()
            cached = metrics.cached_blocks()
            out += [
                counter(
                    "elastickv_allocations",
                    "Successful allocate() calls",
                    stats.allocations,
                ),
                counter(
                    "elastickv_refusals",
                    "allocate() calls answered 'not now'",
                    stats.refusals,
                ),
                counter("elastickv_frees", "free() calls", stats.frees),
                counter("elastickv_pages_committed", "Pages committed", stats.pages_committed),
                counter("elastickv_pages_released", "Pages released", stats.pages_released),
                gauge(
                    "elastickv_backed_blocks",
                    "Blocks handed out and kept on committed pages: in use by requests or "
                    "cached for prefix reuse (the null block not counted)",
                    stats.live_blocks,
                ),
                gauge(
                    "elastickv_in_use_blocks",
                    "Backed blocks that requests use now (backed minus cached)",
                    max(0, stats.live_blocks - cached),
                ),
                gauge(
                    "elastickv_cached_blocks",
                    "Backed blocks no request uses, kept for prefix-cache reuse (evicted first "
                    "when memory is short)",
                    cached,
                ),
                gauge("elastickv_free_blocks", "Usable blocks not in use", stats.free_blocks),
                gauge(
                    "elastickv_hot_pages", "Committed pages under no live block", stats.hot_pages
                ),
            ]
        return out


class MetricsServer:
    """A running metrics endpoint; :meth:`stop` (or leaving the ``with``) shuts it down."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host: str = str(httpd.server_address[0])
        self.port: int = int(httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_metrics_server(
    port: int,
    *,
    host: str = DEFAULT_HOST,
    metrics: InstanceMetrics | None = None,
    registry: CollectorRegistry | None = None,
) -> MetricsServer:
    """Serve ``metrics`` (or ``registry``) at ``http://host:port/metrics`` from a daemon thread.

    Port 0 picks a free port (see ``MetricsServer.port``). The default host is loopback: the
    endpoint exposes names and sizes, so reaching it from elsewhere is a choice to make
    explicitly (and to protect).
    """
    if metrics is not None and registry is None:
        source = metrics.registry
    elif registry is not None and metrics is None:
        source = registry
    else:
        raise ValueError("pass exactly one of metrics= or registry=")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    httpd, thread = start_http_server(port, addr=host, registry=source)
    return MetricsServer(httpd, thread)


__all__ = [
    "DEFAULT_HOST",
    "ENV_METRICS_PORT",
    "InstanceMetrics",
    "MeteredPolicy",
    "MetricsServer",
    "metrics_port_from_env",
    "start_metrics_server",
]
