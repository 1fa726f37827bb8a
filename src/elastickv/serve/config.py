"""What ``elastickv serve`` runs, as frozen descriptions validated once, before anything starts.

A configuration comes from a TOML file (``--config``), from flags, or from neither (two
built-in tiny models of different shapes). Every rejection is a :class:`ServeConfigError`
that names the field, the value and what is accepted.

    [router]                      # optional
    host = "127.0.0.1"
    port = 8080
    queue_limit = 64              # requests waiting per model while it wakes
    wake_timeout = "5m"
    api_key_file = "/etc/elastickv/api-key"   # or ELASTICKV_API_KEY; required off loopback
    allow_unauthenticated = false # true: listen beyond loopback without a key
    models_api = false            # true: models added and removed at run time (needs a key)

    [device]
    budget = "2G"                 # the KV bytes all models share (B)
    page_size = "2M"
    mode = "elastic"              # "static": native vLLM, budget/N each (a baseline)

    [[model]]
    name = "chat"                 # served name (the `model` field of a request)
    model = "/models/llama"       # a model directory, or a built-in tiny model name
    args = ["--max-model-len", "4096"]
    min_kv = "256M"               # guaranteed
    max_kv = "1G"                 # cap
    priority = 1                  # higher wins when models compete
    pinned = false                # never stopped
    release_after = "30s"         # idle time before its KV is released (tier 1)
    sleep_after = "2m"            # idle time before its weights sleep (tier 2), or "never"
    stop_after = "10m"            # idle time before its engine stops (tier 3), or "never"
    env = { VLLM_CPU_OMP_THREADS_BIND = "0" }   # extra environment for its engine

    [[model]]                     # one model as a prefill engine + a decode engine (NIXL)
    name = "chat-pd"
    model = "/models/llama"
    [model.pd]                    # or, in the [[model]] table: pd = true
    prefill_env = { VLLM_CPU_OMP_THREADS_BIND = "0" }
    decode_env = { VLLM_CPU_OMP_THREADS_BIND = "1" }

A ``pd`` model is served under its name and runs as two engines, ``<name>/prefill`` and
``<name>/decode`` (each with the model's args, min_kv and max_kv, plus ``prefill_args`` /
``decode_args`` and the ``*_env`` tables; ``nixl_progress_wait_ms`` sets how their idle NIXL
progress threads wait); the router does the two-step exchange.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from elastickv.integrations.vllm.transfer.nixl_progress import MAX_WAIT_MS
from elastickv.serve.auth import (
    ApiKey,
    ApiKeyError,
    is_loopback,
    key_from_environment,
    read_key_file,
)
from elastickv.units import format_bytes, parse_duration, parse_size

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE_LIMIT = 64
DEFAULT_WAKE_TIMEOUT_S = 300.0
DEFAULT_PAGE_SIZE = 2 << 20
DEFAULT_RELEASE_AFTER_S = 30.0
DEFAULT_STOP_AFTER_S = 600.0
DEFAULT_SLEEP_AFTER_S = 120.0
# ``ModelConfig.sleep_after_s`` meaning "not given": the default where it fits between the
# model's release_after and stop_after, else never (see ModelConfig.__post_init__).
SLEEP_AFTER_UNSET = -1.0
DEFAULT_HOT_MAX_PAGES = 4
# A model's min_kv when none is given: this much, or its share of the budget if that is less.
DEFAULT_MIN_KV = 64 << 20
# ``ModelConfig.min_kv`` meaning "not given": :class:`ServeConfig` resolves it (see
# :func:`default_min_kv`), so every model of a configuration has its real floor.
MIN_KV_UNSET = 0
# The no-argument configuration: the built-in models on a small budget in small pages, so
# memory visibly moves between them.
BUILTIN_BUDGET = 32 << 20
BUILTIN_PAGE_SIZE = 64 << 10
BUILTIN_MIN_KV = 4 << 20
BUILTIN_MAX_KV = 24 << 20
_NEVER = frozenset({"never", "none", "off"})
_NAME = re.compile(r"^[A-Za-z0-9][\w.:@+\-/]{0,63}$")


class ServeConfigError(ValueError):
    """A configuration value that cannot be served; the message says which and why."""


@dataclass(frozen=True)
class ModelConfig:
    """One served model."""

    name: str
    source: str  # a directory, or a built-in tiny model name
    args: tuple[str, ...] = ()
    min_kv: int = MIN_KV_UNSET  # resolved by ServeConfig: see default_min_kv
    max_kv: int | None = None  # None: the device budget minus the other models' floors
    priority: int = 0
    pinned: bool = False  # never stopped: stop_after_s is then None
    release_after_s: float | None = DEFAULT_RELEASE_AFTER_S
    stop_after_s: float | None = DEFAULT_STOP_AFTER_S
    sleep_after_s: float | None = SLEEP_AFTER_UNSET  # None: never (P/D engines: always None)
    python: str | None = None  # the interpreter with vLLM; None: the serve-wide choice
    env: tuple[tuple[str, str], ...] = ()  # extra environment for the engine
    role: str | None = None  # "prefill" or "decode": one engine of a P/D pair
    group: str | None = None  # a P/D engine's pair: the name clients use
    # A P/D engine: NIXL's progress thread's wait (0: it spins; None: the plugin's default).
    nixl_progress_wait_ms: int | None = None

    def __post_init__(self) -> None:
        if self.pinned:  # the readers refuse pinned with a stop_after (a contradiction)
            object.__setattr__(self, "stop_after_s", None)
        if self.sleep_after_s == SLEEP_AFTER_UNSET:
            object.__setattr__(self, "sleep_after_s", self._default_sleep_after())
        if self.role is not None:  # a P/D engine's weights stay awake (not supported yet)
            object.__setattr__(self, "sleep_after_s", None)

    def _default_sleep_after(self) -> float | None:
        """The default idle time before sleep, where it falls after release_after and before
        stop_after; else never (a model set to stop sooner stops without sleeping first)."""
        default = DEFAULT_SLEEP_AFTER_S
        release, stop = self.release_after_s, self.stop_after_s
        if (release is not None and release >= default) or (stop is not None and stop <= default):
            return None
        return default

    @property
    def served_name(self) -> str:
        """The name the engine answers to (a P/D engine: its pair's)."""
        return self.group or self.name

    @property
    def builtin(self) -> bool:
        from elastickv.models import BUILTIN_MODELS

        return self.source in BUILTIN_MODELS and not os.path.isdir(self.source)


@dataclass(frozen=True)
class ServeConfig:
    """The whole deployment: router, the device's shared KV budget, the models."""

    models: tuple[ModelConfig, ...]
    budget: int
    page_size: int = DEFAULT_PAGE_SIZE
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    queue_limit: int = DEFAULT_QUEUE_LIMIT
    wake_timeout_s: float = DEFAULT_WAKE_TIMEOUT_S
    python: str | None = None
    log_dir: str | None = None
    hot_max_pages: int = DEFAULT_HOT_MAX_PAGES
    mode: str = "elastic"  # or "static": native vLLM, a fixed budget/N each (a baseline)
    source: str = "built-in defaults"  # where it came from, for messages
    api_key: ApiKey | None = None  # required by every route of the router when set
    allow_unauthenticated: bool = False  # listen beyond loopback without a key
    models_api: bool = False  # models added and removed at run time (/admin/models)

    @property
    def static(self) -> bool:
        return self.mode == "static"

    def model(self, name: str) -> ModelConfig:
        return next(m for m in self.models if m.name == name)

    def cap_of(self, model: ModelConfig) -> int:
        """The model's effective cap: ``max_kv``, else what the others' floors leave; in
        static mode its fixed share, ``budget / number of models``."""
        if self.static:
            return self.budget // len(self.models)
        others = sum(m.min_kv for m in self.models if m is not model)
        cap = self.budget - others if model.max_kv is None else model.max_kv
        return min(cap, self.budget - others)

    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def pairs(self) -> dict[str, tuple[ModelConfig, ModelConfig]]:
        """The P/D models: served name -> (prefill engine, decode engine)."""
        found: dict[str, dict[str, ModelConfig]] = {}
        for m in self.models:
            if m.group is not None and m.role is not None:
                found.setdefault(m.group, {})[m.role] = m
        return {name: (roles["prefill"], roles["decode"]) for name, roles in found.items()}

    def served_names(self) -> list[str]:
        """What clients may put in a request's ``model`` field, in configuration order."""
        return list(dict.fromkeys(m.served_name for m in self.models))

    def __post_init__(self) -> None:
        if any(m.min_kv == MIN_KV_UNSET for m in self.models):
            floor = default_min_kv(self.budget, len(self.models), self.page_size)
            models = tuple(
                replace(m, min_kv=floor) if m.min_kv == MIN_KV_UNSET else m for m in self.models
            )
            object.__setattr__(self, "models", models)
        _validate(self)


def default_min_kv(budget: int, engines: int, page_size: int) -> int:
    """A model's ``min_kv`` when none is given: ``DEFAULT_MIN_KV``, or an even share of the
    budget among the engines if that is less, in whole pages (at least one)."""
    floor = min(DEFAULT_MIN_KV, budget // max(1, engines))
    if page_size > 0:
        floor = max(page_size, floor // page_size * page_size)
    return floor


def builtin_config(**overrides: Any) -> ServeConfig:
    """No configuration at all: the two built-in tiny models (different shapes) sharing a
    small budget in small pages, so memory visibly moves between them. Their idle tiers are
    every model's defaults."""
    models = tuple(
        ModelConfig(
            name=name,
            source=name,
            args=("--enforce-eager",),
            min_kv=BUILTIN_MIN_KV,
            max_kv=BUILTIN_MAX_KV,
        )
        for name in ("tiny-llama", "tiny-llama-bf16")
    )
    values: dict[str, Any] = {
        "models": models,
        "budget": BUILTIN_BUDGET,
        "page_size": BUILTIN_PAGE_SIZE,
    }
    values.update(overrides)
    return ServeConfig(**values)


# -- reading ----------------------------------------------------------------------------------

_ROUTER_KEYS = {
    "host",
    "port",
    "queue_limit",
    "wake_timeout",
    "api_key_file",
    "allow_unauthenticated",
    "models_api",
}
_DEVICE_KEYS = {"budget", "page_size", "hot_max_pages", "mode"}
MODES = ("elastic", "static")
_TOP_KEYS = {"router", "device", "model", "python", "log_dir"}
_MODEL_KEYS = {
    "name",
    "model",
    "args",
    "min_kv",
    "max_kv",
    "priority",
    "pinned",
    "release_after",
    "sleep_after",
    "stop_after",
    "python",
    "env",
    "pd",
}
_PD_KEYS = {"prefill_args", "decode_args", "prefill_env", "decode_env", "nixl_progress_wait_ms"}
PD_ROLES = ("prefill", "decode")
# Set by serve for every engine; a configuration that sets them is refused.
_SERVE_OWNED_ENV = (
    "ELASTICKV",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    "VLLM_RPC_BASE_PATH",
    "TMPDIR",
)


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None, **overrides: Any
) -> ServeConfig:
    """Read a TOML file; ``overrides`` (from flags; None = not given) win over it. ``environ``
    (the process environment for a command) may hold the API key, ``ELASTICKV_API_KEY``."""
    file = Path(path)
    try:
        data = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise ServeConfigError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise ServeConfigError(f"--config {path}: cannot read it: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ServeConfigError(f"--config {path}: not valid TOML: {exc}") from None
    return config_from_mapping(data, source=str(path), environ=environ, **overrides)


def config_from_mapping(
    data: Mapping[str, Any],
    *,
    source: str,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServeConfig:
    """Build a :class:`ServeConfig` from parsed TOML (see the module doc for the fields). The
    API key: ``overrides["api_key"]``, else ``[router] api_key_file``, else ``environ``'s
    ``ELASTICKV_API_KEY``."""
    _unknown(data, _TOP_KEYS, "the top level")
    router = _table(data, "router")
    device = _table(data, "device")
    _unknown(router, _ROUTER_KEYS, "[router]")
    _unknown(device, _DEVICE_KEYS, "[device]")
    raw_models = data.get("model", [])
    models_api = bool(overrides.get("models_api")) or _bool(
        router.get("models_api", False), "[router] models_api"
    )
    if not isinstance(raw_models, list) or (not raw_models and not models_api):
        raise ServeConfigError(
            f"{source}: no [[model]] tables; add at least one, e.g.\n"
            '[[model]]\nname = "tiny-llama"\nmodel = "tiny-llama"\n'
            "(or set [router] models_api = true to add them at run time)"
        )
    models = tuple(m for i, raw in enumerate(raw_models) for m in _models(raw, i))
    values: dict[str, Any] = {"models": models, "source": source}
    if "budget" not in device:
        raise ServeConfigError(
            f"{source}: [device] budget is required: the KV bytes all models share, e.g. "
            'budget = "8G"'
        )
    values["budget"] = _size(device["budget"], "[device] budget")
    tables = {"device": device, "router": router, "": data}
    for section, key, field, read in _SERVE_FIELDS:
        table = tables[section]
        if key in table:
            values[field] = read(table[key], f"[{section}] {key}" if section else key)
    if "allow_unauthenticated" in router:
        values["allow_unauthenticated"] = _bool(
            router["allow_unauthenticated"], "[router] allow_unauthenticated"
        )
    values["models_api"] = models_api
    if overrides.get("api_key") is None:
        file = router.get("api_key_file")
        values["api_key"] = _api_key(
            None if file is None else _str(file, "[router] api_key_file"),
            "[router] api_key_file",
            environ,
        )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ServeConfig(**values)


def _api_key(file: str | None, label: str, environ: Mapping[str, str] | None) -> ApiKey | None:
    """The key in ``file`` (the setting ``label``), else ``ELASTICKV_API_KEY``, else None."""
    try:
        if file is not None:
            return read_key_file(file, label)
        return key_from_environment(environ or {})
    except ApiKeyError as exc:
        raise ServeConfigError(str(exc)) from None


def api_key_value(file: str | None, label: str, environ: Mapping[str, str] | None) -> ApiKey | None:
    """The API key a command uses: ``file`` (its setting ``label``, e.g. ``--api-key-file``)
    if given, else ``ELASTICKV_API_KEY`` in ``environ``; errors are ServeConfigError."""
    return _api_key(file, label, environ)


def _wake_timeout(value: Any, label: str) -> float | None:
    return _duration(value, label, allow_never=False)


# (table, key, ServeConfig field, reader) of the optional serve-wide settings.
_SERVE_FIELDS: tuple[tuple[str, str, str, Callable[[Any, str], Any]], ...] = (
    ("device", "page_size", "page_size", lambda v, label: page_size_value(v, label)),
    ("device", "mode", "mode", lambda v, label: _str(v, label)),
    ("device", "hot_max_pages", "hot_max_pages", lambda v, label: _int(v, label)),
    ("router", "host", "host", lambda v, label: _str(v, label)),
    ("router", "port", "port", lambda v, label: _int(v, label)),
    ("router", "queue_limit", "queue_limit", lambda v, label: _int(v, label)),
    ("router", "wake_timeout", "wake_timeout_s", lambda v, label: _wake_timeout(v, label)),
    ("", "python", "python", lambda v, label: _str(v, label)),
    ("", "log_dir", "log_dir", lambda v, label: _str(v, label)),
)


def config_from_flags(
    models: Sequence[str],
    *,
    min_kv: str | None,
    max_kv: str | None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServeConfig:
    """``--model [NAME=]SOURCE`` (repeated) with shared ``--min-kv`` / ``--max-kv``; no
    ``--model`` at all: the built-in models, or none with ``models_api`` (they are added at
    run time). The API key: ``overrides["api_key"]``, else ``ELASTICKV_API_KEY`` in
    ``environ``."""
    if overrides.get("api_key") is None:
        overrides["api_key"] = _api_key(None, "", environ)
    if not models:
        if min_kv is not None or max_kv is not None:
            raise ServeConfigError("--min-kv / --max-kv need --model (or a --config file)")
        given = {k: v for k, v in overrides.items() if v is not None}
        if given.get("models_api"):
            if "budget" not in given:
                raise ServeConfigError(
                    "--budget is required with --models-api: the KV bytes the models added "
                    "at run time share, e.g. --budget 8G"
                )
            return ServeConfig(models=(), source="flags", **given)
        return builtin_config(**given)
    built = []
    for i, spec in enumerate(models):
        name, _, source = spec.rpartition("=")
        source = source.strip()
        raw: dict[str, Any] = {"model": source, "name": name.strip() or _default_name(source)}
        if min_kv is not None:
            raw["min_kv"] = min_kv
        if max_kv is not None:
            raw["max_kv"] = max_kv
        built.append(_model(raw, i, where=f"--model {spec!r}"))
    values: dict[str, Any] = {"models": tuple(built), "source": "flags"}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "budget" not in values:
        raise ServeConfigError(
            "--budget is required with --model: the KV bytes all models share, e.g. --budget 8G"
        )
    return ServeConfig(**values)


def _default_name(source: str) -> str:
    return os.path.basename(source.rstrip("/")) or source


def _models(raw: Any, index: int) -> tuple[ModelConfig, ...]:
    """One ``[[model]]`` table: one model, or a P/D model's two engines."""
    model = _model(raw, index)
    if "pd" not in raw:
        return (model,)
    label = f"[[model]] #{index + 1} ({model.name!r}) pd"
    pd = raw["pd"]
    if pd is True:
        pd = {}
    if not isinstance(pd, Mapping):
        raise ServeConfigError(
            f"{label} = {pd!r}: use true, or a table with {', '.join(sorted(_PD_KEYS))}"
        )
    _unknown(pd, _PD_KEYS, label)
    if has_kv_transfer_config(model.args):
        raise ServeConfigError(
            f"{label}: args set --kv-transfer-config; a pd model's engines get theirs from serve "
            "(NixlConnector); remove it"
        )
    wait_ms = _nixl_wait(pd.get("nixl_progress_wait_ms"), f"{label} nixl_progress_wait_ms")
    engines = []
    for role in PD_ROLES:
        extra = _args(pd.get(f"{role}_args", []), f"{label} {role}_args")
        if has_kv_transfer_config(extra):
            raise ServeConfigError(
                f"{label} {role}_args set --kv-transfer-config; serve sets it; remove it"
            )
        env = dict(model.env)
        env.update(_env(pd.get(f"{role}_env", {}), f"{label} {role}_env"))
        engines.append(
            replace(
                model,
                name=f"{model.name}/{role}",
                args=model.args + extra,
                env=tuple(env.items()),
                role=role,
                group=model.name,
                nixl_progress_wait_ms=wait_ms,
            )
        )
    return tuple(engines)


def _nixl_wait(value: Any, label: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WAIT_MS:
        raise ServeConfigError(
            f"{label} = {value!r}: use a whole number of milliseconds from 0 to {MAX_WAIT_MS}, "
            "e.g. 5 (0: NIXL's own progress thread, which spins on a core)"
        )
    return value


def has_option(args: Sequence[str], option: str) -> bool:
    """Whether vLLM arguments set ``option`` (``--name value`` or ``--name=value``)."""
    return any(a == option or a.startswith(option + "=") for a in args)


def has_kv_transfer_config(args: Sequence[str]) -> bool:
    """Whether vLLM arguments set the KV connector (either spelling vLLM accepts)."""
    return has_option(args, "--kv-transfer-config") or has_option(args, "--kv_transfer_config")


def _args(value: Any, label: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list):
        raise ServeConfigError(
            f'{label} = {value!r}: must be a list of strings, e.g. ["--max-model-len", "4096"]'
        )
    return tuple(_str(a, f"{label}[{i}]") for i, a in enumerate(value))


def _env(value: Any, label: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ServeConfigError(
            f"{label} = {value!r}: must be a table of strings, e.g. "
            '{ VLLM_CPU_OMP_THREADS_BIND = "0" }'
        )
    env = {}
    for key, item in value.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key)):
            raise ServeConfigError(f"{label}: {key!r} is not an environment variable name")
        if key.startswith("ELASTICKV") or key in _SERVE_OWNED_ENV:
            raise ServeConfigError(
                f"{label}: {key} is set by serve from the configuration; remove it"
            )
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise ServeConfigError(f"{label} {key} = {item!r}: must be a string or a number")
        env[key] = str(item)
    return env


def model_from_mapping(raw: Any, where: str) -> ModelConfig:
    """One model described as a ``[[model]]`` table (parsed TOML, or JSON sent to the models
    API), checked field by field; ``where`` names it in errors. A ``pd`` model is refused
    here: it is two engines (see :func:`config_from_mapping`)."""
    if isinstance(raw, Mapping) and "pd" in raw:
        raise ServeConfigError(f"{where}: pd models are served from a configuration file only")
    return _model(raw, 0, where=where)


def _model(raw: Any, index: int, where: str | None = None) -> ModelConfig:
    label = where or f"[[model]] #{index + 1}"
    if not isinstance(raw, Mapping):
        raise ServeConfigError(f"{label}: must be a table, got {raw!r}")
    if isinstance(raw.get("name"), str):
        label = f"{label} ({raw['name']!r})" if where is None else label
    _unknown(raw, _MODEL_KEYS, label)
    if "model" not in raw:
        raise ServeConfigError(
            f"{label}: 'model' is required: a model directory or a built-in tiny model name "
            f"({_builtin_names()})"
        )
    source = _str(raw["model"], f"{label} model")
    values: dict[str, Any] = {
        "source": source,
        "name": _str(raw.get("name", _default_name(source)), f"{label} name"),
    }
    if "args" in raw:
        values["args"] = _args(raw["args"], f"{label} args")
    if "env" in raw:
        values["env"] = tuple(_env(raw["env"], f"{label} env").items())
    if "min_kv" in raw:
        values["min_kv"] = _size(raw["min_kv"], f"{label} min_kv")
    if "max_kv" in raw:
        values["max_kv"] = _size(raw["max_kv"], f"{label} max_kv")
    if "priority" in raw:
        values["priority"] = _int(raw["priority"], f"{label} priority")
    if "pinned" in raw:
        if not isinstance(raw["pinned"], bool):
            raise ServeConfigError(f"{label} pinned = {raw['pinned']!r}: use true or false")
        values["pinned"] = raw["pinned"]
    if "release_after" in raw:
        values["release_after_s"] = _duration(raw["release_after"], f"{label} release_after")
    if "sleep_after" in raw:
        if "pd" in raw:
            raise ServeConfigError(
                f"{label}: sleep_after is not supported for a pd model yet (its two engines "
                "stay awake until stop_after); remove it"
            )
        values["sleep_after_s"] = _duration(raw["sleep_after"], f"{label} sleep_after")
    if "stop_after" in raw:
        values["stop_after_s"] = _duration(raw["stop_after"], f"{label} stop_after")
        if values.get("pinned") and values["stop_after_s"] is not None:
            raise ServeConfigError(
                f"{label}: pinned = true never stops it, but stop_after = "
                f"{raw['stop_after']!r} stops it after {values['stop_after_s']:g} s idle; "
                'remove one of them (pinned = true is the same as stop_after = "never")'
            )
    if "python" in raw:
        values["python"] = _str(raw["python"], f"{label} python")
    return ModelConfig(**values)


# -- validation -------------------------------------------------------------------------------


def _validate(config: ServeConfig) -> None:
    if not config.models and not config.models_api:
        raise ServeConfigError("no models to serve")
    if config.mode not in MODES:
        raise ServeConfigError(
            f'[device] mode = {config.mode!r}: use "elastic" (default) or "static"'
        )
    page = config.page_size
    if not _page_size_ok(page):
        os_page = format_bytes(os.sysconf("SC_PAGE_SIZE"))
        raise ServeConfigError(
            f"[device] page_size = {format_bytes(page)} ({page} bytes): "
            + _PAGE_RULE.format(os_page=os_page)
        )
    seen: set[str] = set()
    for m in config.models:
        if m.name in seen:
            raise ServeConfigError(f"model name {m.name!r} is used twice; served names must differ")
        seen.add(m.name)
        if m.group is not None and m.group in {o.name for o in config.models}:
            raise ServeConfigError(
                f"model name {m.group!r} is used twice (a pd model and another model); served "
                "names must differ"
            )
        check_model(m, page_size=config.page_size, static=config.static)
    floors = sum(m.min_kv for m in config.models)
    if floors > config.budget:
        parts = [format_bytes(m.min_kv) for m in config.models]
        total = " + ".join(parts) + f" = {format_bytes(floors)}" if len(parts) > 1 else parts[0]
        raise ServeConfigError(
            f"[device] budget = {format_bytes(config.budget)} cannot guarantee the models' "
            f"min_kv ({total}); raise the budget or lower a min_kv"
        )
    if not 0 <= config.hot_max_pages <= 1024:
        raise ServeConfigError(f"[device] hot_max_pages = {config.hot_max_pages}: use 0..1024")
    if not 0 <= config.port <= 65535:
        raise ServeConfigError(f"[router] port = {config.port}: not a TCP port (0-65535)")
    if not config.host.strip():
        raise ServeConfigError("[router] host must not be empty (default 127.0.0.1)")
    if config.queue_limit < 0:
        raise ServeConfigError(f"[router] queue_limit = {config.queue_limit}: must be >= 0")
    if not config.wake_timeout_s > 0:
        raise ServeConfigError(f"[router] wake_timeout = {config.wake_timeout_s}: must be > 0")
    if config.python is not None:
        _check_python(config.python, "python")
    _check_listener(config)


def check_model(model: ModelConfig, *, page_size: int, static: bool, source: bool = True) -> None:
    """The checks of one model that need no other model: its name, its source (unless
    ``source`` is False: a cluster's driver may not see the directories its nodes see), its
    sizes against the page size, its idle tiers, its Python."""
    m = model
    if not _NAME.match(m.name):
        raise ServeConfigError(
            f"model name {m.name!r}: use 1-64 letters, digits and . _ - : @ + /, starting "
            "with a letter or digit"
        )
    if source:
        _check_source(m)
    if static and m.nixl_progress_wait_ms is not None:
        raise ServeConfigError(
            f"model {m.name!r}: nixl_progress_wait_ms needs elastickv in the engine, and "
            '[device] mode = "static" runs native vLLM; remove it or use mode "elastic"'
        )
    if m.min_kv < page_size:
        default = " (the default)" if page_size == DEFAULT_PAGE_SIZE else ""
        raise ServeConfigError(
            f"model {m.name!r} min_kv = {format_bytes(m.min_kv)} is smaller than one page "
            f"([device] page_size = {format_bytes(page_size)}{default}); give it at "
            "least the engine's null block and one request, or use smaller pages (e.g. "
            'page_size = "64K")'
        )
    if m.max_kv is not None and m.max_kv < m.min_kv:
        raise ServeConfigError(
            f"model {m.name!r} max_kv = {format_bytes(m.max_kv)} is below its min_kv "
            f"({format_bytes(m.min_kv)})"
        )
    if m.release_after_s is not None and m.release_after_s <= 0:
        raise ServeConfigError(f"model {m.name!r} release_after must be positive or never")
    if m.stop_after_s is not None and m.stop_after_s <= 0:
        raise ServeConfigError(f"model {m.name!r} stop_after must be positive or never")
    release, stop = m.release_after_s, m.stop_after_s
    if release is not None and stop is not None and stop <= release:
        default = " (the default)" if release == DEFAULT_RELEASE_AFTER_S else ""
        raise ServeConfigError(
            f"model {m.name!r} stop_after = {stop:g}s is not longer than its release_after "
            f"= {release:g}s{default}: its engine would stop before its KV is released; "
            f'set release_after below {stop:g}s, or release_after = "never" to go straight '
            "to stopping"
        )
    _check_sleep_after(m)
    if m.python is not None:
        _check_python(m.python, f"model {m.name!r} python")


def _check_sleep_after(m: ModelConfig) -> None:
    """The asleep tier sits between the two others: release_after < sleep_after < stop_after."""
    sleep = m.sleep_after_s
    if sleep is None:
        return
    if sleep <= 0:
        raise ServeConfigError(f"model {m.name!r} sleep_after must be positive or never")
    if m.release_after_s is not None and sleep <= m.release_after_s:
        raise ServeConfigError(
            f"model {m.name!r} sleep_after = {sleep:g}s is not longer than its release_after "
            f"= {m.release_after_s:g}s: a sleeping model's KV is already released; set "
            f"sleep_after above {m.release_after_s:g}s"
        )
    if m.stop_after_s is not None and sleep >= m.stop_after_s:
        raise ServeConfigError(
            f"model {m.name!r} sleep_after = {sleep:g}s is not shorter than its stop_after = "
            f"{m.stop_after_s:g}s: its engine would stop before it sleeps; set sleep_after "
            f'below {m.stop_after_s:g}s, or sleep_after = "never"'
        )


def _check_listener(config: ServeConfig) -> None:
    """No router beyond loopback without a key unless asked; no models API without a key."""
    if config.models_api and config.api_key is None:
        raise ServeConfigError(
            "[router] models_api = true lets whoever calls it start engines; it needs an API "
            "key: [router] api_key_file = FILE (--api-key-file FILE) or ELASTICKV_API_KEY"
        )
    if is_loopback(config.host) or config.api_key is not None:
        return
    if not config.allow_unauthenticated:
        raise ServeConfigError(
            f"[router] host = {config.host!r} exposes the models to everyone who can reach "
            "it, and no API key is set; give one ([router] api_key_file = FILE, "
            "--api-key-file FILE, or ELASTICKV_API_KEY), or serve without one on purpose: "
            "[router] allow_unauthenticated = true (--allow-unauthenticated)"
        )


def _check_source(model: ModelConfig) -> None:
    if model.builtin:
        return
    path = Path(model.source).expanduser()
    if not path.is_dir():
        from elastickv.models import BUILTIN_MODELS

        close = difflib.get_close_matches(model.source, list(BUILTIN_MODELS), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ServeConfigError(
            f"model {model.name!r}: model = {model.source!r} is neither a model directory nor a "
            f"built-in tiny model ({_builtin_names()}){hint}"
        )
    if not (path / "config.json").is_file():
        raise ServeConfigError(
            f"model {model.name!r}: {model.source!r} has no config.json; point it at a Hugging "
            "Face model directory"
        )


def _check_python(python: str, label: str) -> None:
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ServeConfigError(f"{label} = {python!r} is not an executable file")


def _builtin_names() -> str:
    from elastickv.models import BUILTIN_MODELS

    return ", ".join(BUILTIN_MODELS)


# -- typed field readers ----------------------------------------------------------------------


def _unknown(table: Mapping[str, Any], known: set[str], where: str) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise ServeConfigError(
            f"{where}: unknown field(s) {', '.join(extra)}; accepted: {', '.join(sorted(known))}"
        )


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ServeConfigError(f"[{key}] must be a table, got {value!r}")
    return value


def _str(value: Any, label: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ServeConfigError(f"{label} = {value!r}: must be a non-empty string")
    return value.strip()


def _bool(value: Any, label: str) -> bool:
    if not isinstance(value, bool):
        raise ServeConfigError(f"{label} = {value!r}: use true or false")
    return value


def _int(value: Any, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServeConfigError(f"{label} = {value!r}: must be a whole number")
    return value


_PAGE_RULE = "must be a power of two and a multiple of the OS page size ({os_page}), e.g. 64K or 2M"


def _page_size_ok(page: int) -> bool:
    return page > 0 and page % os.sysconf("SC_PAGE_SIZE") == 0 and page & (page - 1) == 0


def page_size_value(value: Any, label: str) -> int:
    """A page size as typed (``"64K"``, ``65536``); the error echoes it as typed."""
    page = _size(value, label)
    if not _page_size_ok(page):
        raise ServeConfigError(
            f"{label} = {value!r} ({format_bytes(page)}): "
            + _PAGE_RULE.format(os_page=format_bytes(os.sysconf("SC_PAGE_SIZE")))
        )
    return page


def size_value(value: Any, label: str) -> int:
    """A positive size as typed (``"8G"``, ``4096``); the error names ``label``."""
    return _size(value, label)


def _size(value: Any, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ServeConfigError(f'{label} = {value!r}: use a size such as "512M" or "2G"')
    try:
        size = parse_size(value) if isinstance(value, str) else value
    except ValueError:
        raise ServeConfigError(
            f'{label} = {value!r}: not a size; use bytes or K/M/G/T, e.g. "512M", "2G"'
        ) from None
    if size <= 0:
        raise ServeConfigError(f"{label} = {value!r}: must be positive")
    return size


def duration_value(value: Any, label: str, *, allow_never: bool = True) -> float | None:
    """A positive duration as typed (``"30s"``, ``"5m"``, seconds as a number), or None for
    ``"never"`` when ``allow_never``; the error names ``label``."""
    return _duration(value, label, allow_never=allow_never)


def _duration(value: Any, label: str, *, allow_never: bool = True) -> float | None:
    if allow_never and isinstance(value, str) and value.strip().lower() in _NEVER:
        return None
    if isinstance(value, bool):
        value = repr(value)
    try:
        seconds = parse_duration(value) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        accepted = '"30s", "5m", "1h", seconds as a number' + (
            ', or "never"' if allow_never else ""
        )
        raise ServeConfigError(f"{label} = {value!r}: not a positive duration; use {accepted}")
    return seconds


__all__ = [
    "ModelConfig",
    "ServeConfig",
    "ServeConfigError",
    "builtin_config",
    "check_model",
    "config_from_flags",
    "config_from_mapping",
    "load_config",
    "model_from_mapping",
]
