"""``elastickv cluster``'s configuration: what a good one becomes, an exact error for every bad
field before anything starts, where each node finds the API key, and the command's checks
(the real Ray Serve deployment is in tests/integration_vllm/test_vllm_plugin_v032_cluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastickv.cluster.config import (
    ClusterConfigError,
    KeySource,
    cluster_config_from_mapping,
    load_cluster_config,
)
from elastickv.serve.config import default_min_kv

KEY = "s3cret-" + "k" * 25
MiB = 1 << 20


def pool(**fields: Any) -> dict[str, Any]:
    return {"name": "hosts", "replicas": 2, "budget": "64M", "page_size": "64K", **fields}


def model(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "model": "tiny-llama", **fields}


def data(*models: dict[str, Any], pools: list[dict[str, Any]] | None = None,
         **tables: Any) -> dict[str, Any]:  # fmt: skip
    return {"pool": pools or [pool()], "model": list(models) or [model("a")], **tables}


def test_a_good_configuration() -> None:
    config = cluster_config_from_mapping(
        data(
            model("a", min_kv="8M", args=["--enforce-eager"]),
            model("b", replicas=2),
            pools=[pool(max_models=2, resources={"elastickv_device": 1}, num_cpus=0.5)],
            ray={"address": "auto"},
            ingress={"port": 9000, "proxy_location": "HeadOnly"},
        ),
        source="t",
    )
    (hosts,) = config.pools
    assert (hosts.replicas, hosts.max_models, hosts.budget) == (2, 2, 64 * MiB)
    assert hosts.page_size == 64 << 10
    assert hosts.resources == (("elastickv_device", 1.0),) and hosts.num_cpus == 0.5
    a, b = config.models
    assert (a.pool, a.copies, b.copies) == ("hosts", 1, 2)
    assert a.config.args == ("--enforce-eager",) and a.config.min_kv == 8 * MiB
    # No min_kv: a replica's share when it holds max_models models, in whole pages.
    assert b.config.min_kv == default_min_kv(64 * MiB, 2, 64 << 10)
    assert a.table == {"name": "a", "model": "tiny-llama", "min_kv": 8 * MiB,
                       "args": ["--enforce-eager"]}  # fmt: skip
    assert "pool" not in b.table and "replicas" not in b.table  # the cluster's, not serve's
    assert config.address == "auto" and config.ingress.port == 9000
    assert config.ingress.key == KeySource(None, required=False)


def test_the_address_comes_from_the_flag_the_file_or_ray_address() -> None:
    base = data(ray={"address": "ray://head:10001"})
    environ = {"RAY_ADDRESS": "10.0.0.1:6379"}
    assert cluster_config_from_mapping(base, source="t", environ=environ).address == (
        "ray://head:10001"
    )
    assert (
        cluster_config_from_mapping(base, source="t", environ=environ, address="auto").address
        == "auto"
    )
    assert cluster_config_from_mapping(data(), source="t", environ=environ).address == (
        "10.0.0.1:6379"
    )
    assert cluster_config_from_mapping(data(), source="t").address is None


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"extra": 1}, "the top level: unknown field(s) extra"),
        ({"pool": []}, "no [[pool]] tables"),
        ({"pool": [pool(name="bad name")]}, "[[pool]] name 'bad name': use 1-64 letters"),
        ({"pool": [pool(name="ingress")]}, "is the ingress's; choose another"),
        ({"pool": [pool(replicas=0)]}, "replicas = 0: must be at least 1"),
        ({"pool": [pool(budget="3X")]}, "budget = '3X': not a size"),
        ({"pool": [pool(page_size="3K")]}, "page_size = '3K'"),
        ({"pool": [pool(resources={"CPU": 1})]}, "CPU is set with num_cpus"),
        ({"pool": [pool(resources={"dev": -1})]}, "resources dev = -1: must be a number >= 0"),
        ({"pool": [pool(tiers=1)]}, "[[pool]] 'hosts': unknown field(s) tiers"),
        ({"pool": [{"name": "p", "replicas": 1}]}, "'budget' is required"),
        ({"pool": [pool(), pool(name="other")]}, "'pool' is required with several pools"),
        ({"pool": [pool(), pool()]}, "[[pool]] name 'hosts' is used twice"),
        ({"model": [model("a", pool="gpus")]}, "pool = 'gpus': no such [[pool]]"),
        ({"model": [model("a", replicas=3)]}, "replicas = 3: pool 'hosts' has 2 replicas"),
        ({"model": [model("a"), model("a")]}, "model name 'a' is used twice"),
        ({"model": [model("a", min_kv="3X")]}, "[[model]] #1 ('a') min_kv = '3X': not a size"),
        ({"model": [model("a", min_kv="1K")]}, "is smaller than one page"),
        ({"model": [model("a", pd=True)]}, "pd models are served from a configuration file"),
        (
            {"model": [model("a", min_kv="40M"), model("b", min_kv="30M"), model("c")]},
            "[[pool]] 'hosts': budget = 64.0 MiB cannot hold max_models = 3 of its models "
            "together (a 40.0 MiB + b 30.0 MiB + c ",
        ),
        (
            {"pool": [pool(), pool(name="idle")], "model": [model("a", pool="hosts")]},
            "[[pool]] 'idle' has no model",
        ),
        ({"ingress": {"port": 0}}, "[ingress] port = 0: not a TCP port"),
        ({"ingress": {"proxy_location": "Nowhere"}}, "use EveryNode or HeadOnly"),
        ({"ingress": {"host": "0.0.0.0"}}, "[ingress] host = '0.0.0.0' exposes the models"),
        ({"ingress": {"api_key_file": "/does/not/exist"}}, "api_key_file /does/not/exist: no such"),
        ({"ray": {"app_name": "a b"}}, "[ray] app_name = 'a b'"),
    ],
)
def test_every_bad_field_is_named(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(ClusterConfigError) as refused:
        cluster_config_from_mapping({**data(), **change}, source="t")
    assert needle in str(refused.value)


def test_an_exposed_ingress_with_a_key_or_on_purpose(tmp_path: Path) -> None:
    exposed = data(ingress={"host": "0.0.0.0"})
    config = cluster_config_from_mapping(exposed, source="t", environ={"ELASTICKV_API_KEY": KEY})
    assert config.ingress.key == KeySource(None, required=True)
    (tmp_path / "key").write_text(KEY)
    keyed = data(ingress={"host": "0.0.0.0", "api_key_file": str(tmp_path / "key")})
    config = cluster_config_from_mapping(keyed, source="t")
    assert config.ingress.key == KeySource(str(tmp_path / "key"), required=True)
    assert KEY not in repr(config)
    allowed = data(ingress={"host": "0.0.0.0", "allow_unauthenticated": True})
    assert not cluster_config_from_mapping(allowed, source="t").ingress.key.required


def test_each_node_reads_its_own_key(tmp_path: Path) -> None:
    """The key never travels through Ray: a node reads the file at the configured path, or
    its own ELASTICKV_API_KEY; a node without it refuses to start its replica."""
    path = tmp_path / "key"
    path.write_text(KEY)
    from_file = KeySource(str(path), required=True).load({})
    assert from_file is not None and from_file.secret == KEY
    from_env = KeySource(None, required=True).load({"ELASTICKV_API_KEY": KEY})
    assert from_env is not None and from_env.secret == KEY
    with pytest.raises(ClusterConfigError, match="this node has no API key"):
        KeySource(None, required=True).load({})
    with pytest.raises(ClusterConfigError, match="no such file"):
        KeySource(str(tmp_path / "elsewhere"), required=True).load({})
    assert KeySource(None, required=False).load({}) is None


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastickv.cli.main", "cluster", *args],
        capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(env or {})},
    )  # fmt: skip


def test_the_command_checks_and_prints_the_plan(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(KEY)
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'[ingress]\nhost = "0.0.0.0"\napi_key_file = "{tmp_path / "key"}"\n'
        '[[pool]]\nname = "hosts"\nreplicas = 2\nbudget = "64M"\nmax_models = 2\n'
        "resources = { elastickv_device = 1 }\n"
        '[[model]]\nname = "a"\nmodel = "tiny-llama"\nmin_kv = "8M"\nreplicas = 2\n'
        '[[model]]\nname = "b"\nmodel = "tiny-llama-bf16"\nmin_kv = "8M"\n'
    )
    proc = cli("--config", str(path), "--check")
    assert proc.returncode == 0, proc.stderr
    assert f"API key from {tmp_path / 'key'} on every node" in proc.stdout
    assert "pool hosts: 2 replicas (resources elastickv_device=1), up to 2 models" in proc.stdout
    assert "a: tiny-llama  min_kv 8.0 MiB  held by 2 replicas at most" in proc.stdout
    assert KEY not in proc.stdout + proc.stderr
    proc = cli("--config", str(path))  # no Ray address anywhere
    assert proc.returncode == 2 and "no Ray cluster given" in proc.stderr
    path.write_text(path.read_text().replace('budget = "64M"', 'budget = "12M"'))
    proc = cli("--config", str(path), "--check")
    assert proc.returncode == 2 and "cannot hold max_models = 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = cli("--config", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_load_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('[[pool]]\nname = "p"\nreplicas = 1\nbudget = "1G"\n[[model]]\nmodel = "x"\n')
    config = load_cluster_config(path)
    assert config.models[0].name == "x" and config.source == str(path)
    path.write_text("[[pool]\n")
    with pytest.raises(ClusterConfigError, match="not valid TOML"):
        load_cluster_config(path)
