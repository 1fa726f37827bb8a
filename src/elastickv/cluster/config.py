"""What ``elastickv cluster`` deploys, as frozen descriptions checked before anything starts.

A TOML file like serve's::

    [ray]
    address = "ray://head:10001"        # or "auto", or RAY_ADDRESS / --address

    [ingress]                           # the one OpenAI endpoint (Ray Serve's HTTP proxy)
    host = "127.0.0.1"                  # anything else needs an API key (or, on purpose,
    port = 8000                         # allow_unauthenticated = true)
    api_key_file = "/etc/elastickv/api-key"   # read on every node; or ELASTICKV_API_KEY there
    proxy_location = "EveryNode"        # or "HeadOnly"
    resources = {}                      # Ray resources the ingress replica takes

    [[pool]]                            # replicas of one kind, one per device
    name = "hosts"
    replicas = 2
    resources = { elastickv_device = 1 }    # each node offers as many as it has devices
    max_models = 2                      # models one replica holds at once (LRU stopped)
    budget = "8G"                       # each replica's serve: its device's KV budget
    page_size = "2M"

    [[model]]                           # serve's [[model]] fields, and:
    name = "chat"
    model = "/models/llama-3-8b"
    pool = "hosts"                      # the pool whose replicas may hold it
    replicas = 2                        # how many of them hold it at once (a hot model)

Every rejection is a :class:`ClusterConfigError` that names the field and the value. Model
directories are not looked for here: the nodes that load a model may see directories this
machine does not (the replica that loads it checks, and the request gets the error).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from elastickv.serve.auth import (
    ApiKey,
    ApiKeyError,
    is_loopback,
    key_from_environment,
    read_key_file,
)
from elastickv.serve.config import (
    DEFAULT_HOT_MAX_PAGES,
    DEFAULT_PAGE_SIZE,
    DEFAULT_QUEUE_LIMIT,
    DEFAULT_WAKE_TIMEOUT_S,
    MIN_KV_UNSET,
    ModelConfig,
    ServeConfigError,
    check_model,
    default_min_kv,
    duration_value,
    model_from_mapping,
    page_size_value,
    size_value,
)
from elastickv.units import format_bytes

DEFAULT_INGRESS_PORT = 8000
DEFAULT_APP_NAME = "elastickv"
DEFAULT_MAX_MODELS = 3  # Ray Serve's own default for max_num_models_per_replica
DEFAULT_MAX_ONGOING = 256
PROXY_LOCATIONS = ("EveryNode", "HeadOnly")
INGRESS_NAME = "ingress"
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_TOP_KEYS = {"ray", "ingress", "pool", "model"}
_RAY_KEYS = {"address", "app_name"}
_INGRESS_KEYS = {
    "host",
    "port",
    "api_key_file",
    "allow_unauthenticated",
    "proxy_location",
    "resources",
    "replicas",
}
_POOL_KEYS = {
    "name",
    "replicas",
    "resources",
    "num_cpus",
    "num_gpus",
    "max_models",
    "max_ongoing_requests",
    "budget",
    "page_size",
    "hot_max_pages",
    "queue_limit",
    "wake_timeout",
    "python",
    "log_dir",
}
# A [[model]] table's fields that are the cluster's; the rest are serve's (sent to a replica).
_PLACEMENT_KEYS = ("pool", "replicas")


class ClusterConfigError(ValueError):
    """A configuration that cannot be deployed; the message says which field and why."""


@dataclass(frozen=True)
class KeySource:
    """Where the API key is on each node: a file (the same path everywhere, e.g. a mounted
    Kubernetes Secret) or ``ELASTICKV_API_KEY`` in the node's environment; ``required`` when
    the configuration has one (a node without it refuses to start its replica). The key
    itself never travels through Ray."""

    file: str | None = None
    required: bool = False

    def load(self, environ: Mapping[str, str]) -> ApiKey | None:
        """The key on this node; ClusterConfigError if required and missing or bad here."""
        try:
            key = read_key_file(self.file, "api_key_file") if self.file else None
            key = key or key_from_environment(environ)
        except ApiKeyError as exc:
            raise ClusterConfigError(str(exc)) from None
        if key is None and self.required:
            raise ClusterConfigError(
                "this node has no API key: the cluster requires one ([ingress] api_key_file "
                "on every node, or ELASTICKV_API_KEY in every node's environment)"
            )
        return key


@dataclass(frozen=True)
class IngressConfig:
    """The OpenAI endpoint: Ray Serve's HTTP proxy and the ingress deployment behind it."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_INGRESS_PORT
    proxy_location: str = "EveryNode"
    resources: tuple[tuple[str, float], ...] = ()
    replicas: int = 1
    allow_unauthenticated: bool = False
    key: KeySource = field(default_factory=KeySource)


@dataclass(frozen=True)
class PoolConfig:
    """Replicas of one kind (a Ray Serve deployment), each one device's ``elastickv serve``."""

    name: str
    replicas: int
    budget: int
    resources: tuple[tuple[str, float], ...] = ()
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    max_models: int = DEFAULT_MAX_MODELS
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING
    page_size: int = DEFAULT_PAGE_SIZE
    hot_max_pages: int = DEFAULT_HOT_MAX_PAGES
    queue_limit: int = DEFAULT_QUEUE_LIMIT
    wake_timeout_s: float = DEFAULT_WAKE_TIMEOUT_S
    python: str | None = None  # the engines' Python on the nodes (default: the replica's)
    log_dir: str | None = None  # engine logs on the nodes (default: serve's temporary one)


@dataclass(frozen=True)
class ClusterModel:
    """A model the cluster serves: serve's description, its pool, and how many of the pool's
    replicas hold it at once (``copies``)."""

    config: ModelConfig
    table: Mapping[str, Any]  # the [[model]] table for serve's models API (min_kv resolved)
    pool: str
    copies: int = 1

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class ClusterConfig:
    pools: tuple[PoolConfig, ...]
    models: tuple[ClusterModel, ...]
    ingress: IngressConfig = field(default_factory=IngressConfig)
    address: str | None = None
    app_name: str = DEFAULT_APP_NAME
    source: str = "flags"

    def pool(self, name: str) -> PoolConfig:
        return next(p for p in self.pools if p.name == name)

    def models_of(self, pool: str) -> tuple[ClusterModel, ...]:
        return tuple(m for m in self.models if m.pool == pool)

    def model(self, name: str) -> ClusterModel | None:
        return next((m for m in self.models if m.name == name), None)


def load_cluster_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None,
    address: str | None = None,
) -> ClusterConfig:  # fmt: skip
    """Read and check a TOML file (``address`` overrides ``[ray] address``; ``environ`` is
    this machine's, for ``ELASTICKV_API_KEY`` and ``RAY_ADDRESS``)."""
    file = Path(path)
    try:
        data = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise ClusterConfigError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise ClusterConfigError(f"--config {path}: cannot read it: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClusterConfigError(f"--config {path}: not valid TOML: {exc}") from None
    return cluster_config_from_mapping(data, source=str(path), environ=environ, address=address)


def cluster_config_from_mapping(
    data: Mapping[str, Any],
    *,
    source: str,
    environ: Mapping[str, str] | None = None,
    address: str | None = None,
) -> ClusterConfig:
    """Build and check a :class:`ClusterConfig` from parsed TOML (see the module doc)."""
    env = environ or {}
    try:
        _unknown(data, _TOP_KEYS, "the top level")
        ray = _table(data, "ray")
        _unknown(ray, _RAY_KEYS, "[ray]")
        ingress = _ingress(_table(data, "ingress"), env)
        pools = tuple(_pool(raw, i) for i, raw in enumerate(_tables(data, "pool", source)))
        _check_pool_names(pools)
        models = tuple(
            _cluster_model(raw, i, pools) for i, raw in enumerate(_tables(data, "model", source))
        )
        given = address or (_str(ray["address"], "[ray] address") if "address" in ray else None)
        config = ClusterConfig(
            pools=pools,
            models=models,
            ingress=ingress,
            address=given or env.get("RAY_ADDRESS") or None,
            app_name=_str(ray.get("app_name", DEFAULT_APP_NAME), "[ray] app_name"),
            source=source,
        )
    except ServeConfigError as exc:  # serve's readers: the same words for the same fields
        raise ClusterConfigError(str(exc)) from None
    check_cluster(config)
    return config


def _check_pool_names(pools: tuple[PoolConfig, ...]) -> None:
    names = [p.name for p in pools]
    for name in names:
        if names.count(name) > 1:
            raise ClusterConfigError(f"[[pool]] name {name!r} is used twice")
        if name == INGRESS_NAME:
            raise ClusterConfigError(f"[[pool]] name {name!r} is the ingress's; choose another")


def check_cluster(config: ClusterConfig) -> None:
    """What must hold across pools and models (each table was checked as it was read)."""
    _check_pool_names(config.pools)
    seen: set[str] = set()
    for m in config.models:
        if m.name in seen:
            raise ClusterConfigError(f"model name {m.name!r} is used twice; names must differ")
        seen.add(m.name)
    for pool in config.pools:
        models = config.models_of(pool.name)
        if not models:
            raise ClusterConfigError(
                f"[[pool]] {pool.name!r} has no model: give a [[model]] pool = {pool.name!r}, "
                "or remove the pool"
            )
        _check_pool_budget(pool, models)
    if not _POOL_NAME.match(config.app_name):
        raise ClusterConfigError(
            f"[ray] app_name = {config.app_name!r}: use letters, digits, _ and -"
        )
    _check_ingress(config.ingress)


def _check_pool_budget(pool: PoolConfig, models: tuple[ClusterModel, ...]) -> None:
    """Any ``max_models`` of the pool's models fit one replica's budget together (their
    ``min_kv`` are guaranteed at once), so a load never waits for a budget that cannot be."""
    floors = sorted((m.config.min_kv for m in models), reverse=True)[: pool.max_models]
    if sum(floors) <= pool.budget:
        return
    largest = sorted(models, key=lambda m: m.config.min_kv, reverse=True)[: pool.max_models]
    parts = " + ".join(f"{m.name} {format_bytes(m.config.min_kv)}" for m in largest)
    raise ClusterConfigError(
        f"[[pool]] {pool.name!r}: budget = {format_bytes(pool.budget)} cannot hold "
        f"max_models = {pool.max_models} of its models together ({parts}); raise the budget, "
        "lower max_models or a min_kv"
    )


def _check_ingress(ingress: IngressConfig) -> None:
    if is_loopback(ingress.host) or ingress.key.required or ingress.allow_unauthenticated:
        return
    raise ClusterConfigError(
        f"[ingress] host = {ingress.host!r} exposes the models to everyone who can reach it, "
        "and no API key is set; give one ([ingress] api_key_file = FILE, or ELASTICKV_API_KEY "
        "on every node), or serve without one on purpose: [ingress] allow_unauthenticated = true"
    )


# -- the tables -------------------------------------------------------------------------------


def _ingress(raw: Mapping[str, Any], environ: Mapping[str, str]) -> IngressConfig:
    _unknown(raw, _INGRESS_KEYS, "[ingress]")
    values: dict[str, Any] = {}
    if "host" in raw:
        values["host"] = _str(raw["host"], "[ingress] host")
    if "port" in raw:
        port = _int(raw["port"], "[ingress] port")
        if not 1 <= port <= 65535:
            raise ClusterConfigError(f"[ingress] port = {port}: not a TCP port (1-65535)")
        values["port"] = port
    if "proxy_location" in raw:
        where = raw["proxy_location"]
        if where not in PROXY_LOCATIONS:
            raise ClusterConfigError(
                f"[ingress] proxy_location = {where!r}: use {' or '.join(PROXY_LOCATIONS)}"
            )
        values["proxy_location"] = where
    if "resources" in raw:
        values["resources"] = _resources(raw["resources"], "[ingress] resources")
    if "replicas" in raw:
        values["replicas"] = _positive(raw["replicas"], "[ingress] replicas")
    if "allow_unauthenticated" in raw:
        values["allow_unauthenticated"] = _bool(
            raw["allow_unauthenticated"], "[ingress] allow_unauthenticated"
        )
    file = _str(raw["api_key_file"], "[ingress] api_key_file") if "api_key_file" in raw else None
    # Read here too: a key this machine cannot read or that is too weak is refused before
    # anything starts (each node reads its own copy when its replicas start).
    try:
        key = read_key_file(file, "[ingress] api_key_file") if file else None
        key = key or key_from_environment(environ)
    except ApiKeyError as exc:
        raise ClusterConfigError(str(exc)) from None
    values["key"] = KeySource(file=file, required=key is not None)
    return IngressConfig(**values)


def _pool(raw: Any, index: int) -> PoolConfig:
    label = f"[[pool]] #{index + 1}"
    if not isinstance(raw, Mapping):
        raise ClusterConfigError(f"{label}: must be a table, got {raw!r}")
    if isinstance(raw.get("name"), str):
        label = f"[[pool]] {raw['name']!r}"
    _unknown(raw, _POOL_KEYS, label)
    for required in ("name", "replicas", "budget"):
        if required not in raw:
            raise ClusterConfigError(
                f"{label}: {required!r} is required (name, replicas: one per device, budget: "
                'each replica\'s KV bytes, e.g. budget = "8G")'
            )
    name = _str(raw["name"], f"{label} name")
    if not _POOL_NAME.match(name):
        raise ClusterConfigError(
            f"[[pool]] name {name!r}: use 1-64 letters, digits, _ and -, starting with a "
            "letter or digit"
        )
    values: dict[str, Any] = {
        "name": name,
        "replicas": _positive(raw["replicas"], f"{label} replicas"),
        "budget": size_value(raw["budget"], f"{label} budget"),
    }
    if "resources" in raw:
        values["resources"] = _resources(raw["resources"], f"{label} resources")
    for key in ("num_cpus", "num_gpus"):
        if key in raw:
            values[key] = _amount(raw[key], f"{label} {key}")
    for key in ("max_models", "max_ongoing_requests"):
        if key in raw:
            values[key] = _positive(raw[key], f"{label} {key}")
    if "page_size" in raw:
        values["page_size"] = page_size_value(raw["page_size"], f"{label} page_size")
    if "hot_max_pages" in raw:
        values["hot_max_pages"] = _int(raw["hot_max_pages"], f"{label} hot_max_pages")
        if not 0 <= values["hot_max_pages"] <= 1024:
            raise ClusterConfigError(f"{label} hot_max_pages = {raw['hot_max_pages']}: 0..1024")
    if "queue_limit" in raw:
        values["queue_limit"] = _int(raw["queue_limit"], f"{label} queue_limit")
        if values["queue_limit"] < 0:
            raise ClusterConfigError(f"{label} queue_limit = {raw['queue_limit']}: must be >= 0")
    if "wake_timeout" in raw:
        values["wake_timeout_s"] = duration_value(
            raw["wake_timeout"], f"{label} wake_timeout", allow_never=False
        )
    for key in ("python", "log_dir"):
        if key in raw:
            values[key] = _str(raw[key], f"{label} {key}")
    return PoolConfig(**values)


def _cluster_model(raw: Any, index: int, pools: tuple[PoolConfig, ...]) -> ClusterModel:
    label = f"[[model]] #{index + 1}"
    if not isinstance(raw, Mapping):
        raise ClusterConfigError(f"{label}: must be a table, got {raw!r}")
    if isinstance(raw.get("name"), str):
        label = f"{label} ({raw['name']!r})"
    table = {k: v for k, v in raw.items() if k not in _PLACEMENT_KEYS}
    model = model_from_mapping(table, where=label)
    if "pool" in raw:
        name = _str(raw["pool"], f"{label} pool")
        pool = next((p for p in pools if p.name == name), None)
        if pool is None:
            known = ", ".join(repr(p.name) for p in pools) or "none"
            raise ClusterConfigError(f"{label} pool = {name!r}: no such [[pool]] (pools: {known})")
    elif len(pools) == 1:
        pool = pools[0]
    else:
        raise ClusterConfigError(
            f"{label}: 'pool' is required with several pools "
            f"({', '.join(repr(p.name) for p in pools) or 'none'})"
        )
    copies = _positive(raw.get("replicas", 1), f"{label} replicas")
    if copies > pool.replicas:
        raise ClusterConfigError(
            f"{label} replicas = {copies}: pool {pool.name!r} has {pool.replicas} replicas; "
            "a model is held by at most that many"
        )
    if model.min_kv == MIN_KV_UNSET:  # a replica's share when it holds max_models models
        model = replace(model, min_kv=default_min_kv(pool.budget, pool.max_models, pool.page_size))
    check_model(model, page_size=pool.page_size, static=False, source=False)
    if model.min_kv > pool.budget:
        raise ClusterConfigError(
            f"{label} min_kv = {format_bytes(model.min_kv)} is more than the budget of pool "
            f"{pool.name!r} ({format_bytes(pool.budget)})"
        )
    table["name"] = model.name
    table["min_kv"] = model.min_kv
    return ClusterModel(model, table, pool.name, copies)


# -- readers ----------------------------------------------------------------------------------


def _unknown(table: Mapping[str, Any], known: set[str], where: str) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise ClusterConfigError(
            f"{where}: unknown field(s) {', '.join(extra)}; accepted: {', '.join(sorted(known))}"
        )


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ClusterConfigError(f"[{key}] must be a table, got {value!r}")
    return value


def _tables(data: Mapping[str, Any], key: str, source: str) -> list[Any]:
    value = data.get(key)
    if not isinstance(value, list) or not value:
        raise ClusterConfigError(
            f"{source}: no [[{key}]] tables; add at least one (see docs/cluster.md)"
        )
    return value


def _str(value: Any, label: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ClusterConfigError(f"{label} = {value!r}: must be a non-empty string")
    return value.strip()


def _bool(value: Any, label: str) -> bool:
    if not isinstance(value, bool):
        raise ClusterConfigError(f"{label} = {value!r}: use true or false")
    return value


def _int(value: Any, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterConfigError(f"{label} = {value!r}: must be a whole number")
    return value


def _positive(value: Any, label: str) -> int:
    number = _int(value, label)
    if number < 1:
        raise ClusterConfigError(f"{label} = {number}: must be at least 1")
    return number


def _amount(value: Any, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ClusterConfigError(f"{label} = {value!r}: must be a number >= 0")
    return float(value)


def _resources(value: Any, label: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, Mapping):
        raise ClusterConfigError(
            f"{label} = {value!r}: must be a table of Ray resources, e.g. "
            "{ elastickv_device = 1 }"
        )
    out = []
    for name, amount in value.items():
        if name in ("CPU", "GPU"):
            raise ClusterConfigError(
                f"{label}: {name} is set with num_cpus / num_gpus (a pool's fields), not here"
            )
        out.append((str(name), _amount(amount, f"{label} {name}")))
    return tuple(out)
