"""The per-instance Prometheus endpoint: scraped over HTTP from 127.0.0.1 while a real
allocator commits and releases pages through the ledger."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from ledger_cases import BUDGET, MiB
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from elastickv.alloc import BlockAllocator, FixedBudget
from elastickv.control import InstanceHandle, Ledger, LedgerPolicy
from elastickv.control.metrics import (
    ENV_METRICS_PORT,
    InstanceMetrics,
    MeteredPolicy,
    metrics_port_from_env,
    start_metrics_server,
)
from elastickv.geometry import KVCacheGeometry
from elastickv.vmm import HostBackend

PAGE = 64 * 1024
# 16 KiB per block over 2 layers: 8 blocks share a 64 KiB page in each layer; 8 MiB in all.
GEOMETRY = KVCacheGeometry(
    num_layers=2, num_blocks=512, num_kv_heads=2, block_size=16, head_size=64
)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    for (sample, found), number in samples.items():
        if sample == name and set(labels.items()) <= set(found):
            return number
    raise KeyError(f"{name} {labels} not scraped; have {sorted({s for s, _ in samples})}")


@pytest.fixture
def handle(ledger: Ledger) -> Iterator[InstanceHandle]:
    with ledger.register("llama-a") as registered:
        yield registered


def test_metrics_follow_allocations(ledger: Ledger, handle: InstanceHandle) -> None:
    metrics = InstanceMetrics(handle)
    with (
        HostBackend(page_size=PAGE).reserve(GEOMETRY.backing_bytes) as vrange,
        BlockAllocator(GEOMETRY, vrange, metrics.metered_policy(LedgerPolicy(handle))) as alloc,
        start_metrics_server(0, metrics=metrics) as server,  # the port the kernel gives
    ):
        metrics.attach_allocator(alloc)
        assert server.host == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
        before = scrape(server.url)
        labels = {"instance_name": "llama-a", "device": "host"}
        assert value(before, "elastickv_registered", **labels) == 1
        null_bytes = handle.committed_bytes  # the null block's pages
        assert value(before, "elastickv_committed_bytes", **labels) == null_bytes
        assert value(before, "elastickv_limit_bytes", **labels) == BUDGET
        assert value(before, "elastickv_limit_desired_bytes", **labels) == -1
        assert value(before, "elastickv_device_budget_bytes", **labels) == BUDGET
        assert value(before, "elastickv_allocations_total", **labels) == 0
        assert value(before, "elastickv_commit_seconds_count", **labels) == 0

        held = [metrics.allocate(alloc, 16) for _ in range(8)]
        assert all(blocks is not None for blocks in held)
        after = scrape(server.url)
        committed = handle.committed_bytes
        assert committed > null_bytes
        assert value(after, "elastickv_committed_bytes", **labels) == committed
        assert value(after, "elastickv_device_used_bytes", **labels) == committed
        assert value(after, "elastickv_allocations_total", **labels) == 8
        assert value(after, "elastickv_ledger_admissions_total", **labels) > 0
        commits = value(after, "elastickv_commit_seconds_count", **labels)
        assert 0 < commits <= 8  # only calls that committed pages are timed
        assert value(after, "elastickv_commit_seconds_sum", **labels) > 0
        assert value(after, "elastickv_commit_seconds_bucket", le="+Inf", **labels) == commits
        assert value(after, "elastickv_backed_blocks", **labels) == 8 * 16
        assert value(after, "elastickv_in_use_blocks", **labels) == 8 * 16  # nothing cached
        assert value(after, "elastickv_cached_blocks", **labels) == 0

        ledger.set_limit("llama-a", committed)  # no more growth
        while metrics.allocate(alloc, 64) is not None:
            pass
        limited = scrape(server.url)
        assert value(limited, "elastickv_limit_revision", **labels) == 2
        assert value(limited, "elastickv_limit_desired_bytes", **labels) == committed
        assert value(limited, "elastickv_refusals_total", **labels) >= 1
        assert value(limited, "elastickv_ledger_refusals_total", **labels) >= 1

        for blocks in held:
            assert blocks is not None
            alloc.free(blocks)
        freed = scrape(server.url)
        assert value(freed, "elastickv_committed_bytes", **labels) < committed
        assert value(freed, "elastickv_ledger_releases_total", **labels) > 0
        assert value(freed, "elastickv_frees_total", **labels) == 8


def test_precommit_and_manual_timing_are_recorded(handle: InstanceHandle) -> None:
    metrics = InstanceMetrics(handle)
    with (
        HostBackend(page_size=PAGE).reserve(GEOMETRY.backing_bytes) as vrange,
        BlockAllocator(
            GEOMETRY,
            vrange,
            metrics.metered_policy(LedgerPolicy(handle)),
            max_hot_pages=8,
        ) as alloc,
    ):
        alloc.set_hot_reserve(4, 8)
        metrics.precommit(alloc)
        with metrics.time_commit():
            pass
        metrics.observe_commit(0.5)
    samples = scrape_registry(metrics.registry)
    assert value(samples, "elastickv_commit_seconds_count") >= 2
    assert value(samples, "elastickv_commit_seconds_bucket", le="1.0") >= 2


def scrape_registry(registry: CollectorRegistry) -> Samples:
    from prometheus_client import generate_latest

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def test_each_instance_has_its_own_registry(ledger: Ledger) -> None:
    with ledger.register("a") as a, ledger.register("b") as b:
        first, second = InstanceMetrics(a), InstanceMetrics(b)
        assert first.registry is not second.registry
        assert a.try_admit(3 * MiB)
        assert value(scrape_registry(first.registry), "elastickv_committed_bytes") == 3 * MiB
        assert value(scrape_registry(second.registry), "elastickv_committed_bytes") == 0
    assert REGISTRY.get_sample_value("elastickv_commit_seconds_count") is None


def test_a_closed_instance_reports_unregistered(ledger: Ledger) -> None:
    handle = ledger.register("gone")
    metrics = InstanceMetrics(handle)
    handle.close()
    samples = scrape_registry(metrics.registry)
    assert value(samples, "elastickv_registered", instance_name="gone") == 0
    with pytest.raises(KeyError):
        value(samples, "elastickv_committed_bytes")


def test_allocator_only_metrics() -> None:
    metrics = InstanceMetrics(name="local")
    with (
        HostBackend(page_size=PAGE).reserve(GEOMETRY.backing_bytes) as vrange,
        BlockAllocator(GEOMETRY, vrange, metrics.metered_policy(FixedBudget(PAGE * 4))) as alloc,
    ):
        metrics.attach_allocator(alloc)
        while metrics.allocate(alloc, 8) is not None:
            pass
        samples = scrape_registry(metrics.registry)
    assert value(samples, "elastickv_refusals_total", instance_name="local") == 1
    assert value(samples, "elastickv_pages_committed_total") == 4
    assert ("elastickv_registered", ()) not in samples


def test_metered_policy_delegates() -> None:
    inner = FixedBudget(10)
    policy = InstanceMetrics(name="x").metered_policy(inner)
    assert isinstance(policy, MeteredPolicy) and policy.inner is inner
    assert policy.try_admit(6) and not policy.try_admit(6)
    assert policy.admitted_bytes == 6 and policy.available_bytes() == 4
    policy.release(6)
    assert inner.admitted_bytes == 0


def test_server_stops_and_frees_its_port() -> None:
    server = start_metrics_server(0, metrics=InstanceMetrics(name="x"))
    assert server.port > 0 and server.running
    assert (
        "elastickv_commit_seconds" in urllib.request.urlopen(server.url, timeout=10).read().decode()
    )
    server.stop()
    server.stop()
    assert not server.running
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)


def test_server_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        start_metrics_server(0)
    with pytest.raises(ValueError, match="port"):
        start_metrics_server(70000, registry=CollectorRegistry())
    with pytest.raises(ValueError, match="handle or an instance name"):
        InstanceMetrics()


def test_metrics_port_from_env() -> None:
    assert metrics_port_from_env({}) is None
    assert metrics_port_from_env({ENV_METRICS_PORT: " "}) is None
    assert metrics_port_from_env({ENV_METRICS_PORT: "9400"}) == 9400
    for bad in ("http", "-1", "65536"):
        with pytest.raises(ValueError, match=ENV_METRICS_PORT):
            metrics_port_from_env({ENV_METRICS_PORT: bad})
