"""Every ``ELASTICKV_*`` setting, parsed and validated in one place into a frozen config.

Why one place: the plugin runs in every vLLM process (API server, engine core, workers),
and each must read the same settings the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.units import parse_size
from elastickv.vmm import DEFAULT_PAGE_SIZE, host_granularity

ENABLE_VAR = "ELASTICKV"
PREFIX = "ELASTICKV_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})

# Setting name -> (variable, help) — the documented surface (docs/vllm.md mirrors it).
SETTINGS: dict[str, tuple[str, str]] = {
    "page_size": ("ELASTICKV_PAGE_SIZE", "bytes committed/released at a time (default 2M)"),
    "hot_min_pages": ("ELASTICKV_HOT_MIN_PAGES", "pages kept committed while idle (default 0)"),
    "hot_max_pages": ("ELASTICKV_HOT_MAX_PAGES", "freed pages kept for reuse (default 4)"),
    "virtual_capacity_bytes": (
        "ELASTICKV_VIRTUAL_CAPACITY",
        "KV capacity advertised to vLLM (default: half of physical memory)",
    ),
    "budget_bytes": ("ELASTICKV_BUDGET", "most physical KV bytes this engine may commit"),
    "strict": ("ELASTICKV_STRICT", "uncommitted pages fault on any access (default 1)"),
    "instance_name": (
        "ELASTICKV_INSTANCE",
        "name in the ledger / `elastickv list` (default: served model name and port)",
    ),
    "ledger_dir": ("ELASTICKV_LEDGER_DIR", "ledger directory (default /dev/shm/elastickv-<uid>)"),
    "metrics_port": ("ELASTICKV_METRICS_PORT", "serve Prometheus metrics on 127.0.0.1:PORT"),
    "check_commits": (
        "ELASTICKV_CHECK_COMMITS",
        "fail if a forward touches KV pages not committed before it (default 0)",
    ),
}


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True only for an explicit opt-in; an unparsable value is an error, not a silent no."""
    env = os.environ if environ is None else environ
    return _parse_bool(ENABLE_VAR, env.get(ENABLE_VAR, "0"))


@dataclass(frozen=True)
class ElasticConfig:
    """The plugin's settings for one engine. Construct via :meth:`from_env`."""

    page_size: int = DEFAULT_PAGE_SIZE
    hot_min_pages: int = 0
    hot_max_pages: int = 4
    virtual_capacity_bytes: int | None = None
    budget_bytes: int | None = None
    strict: bool = True
    instance_name: str | None = None
    check_commits: bool = False
    ledger_dir: str | None = None
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        gran = host_granularity()
        if self.page_size <= 0 or self.page_size % gran:
            raise ElasticKVStartupError(
                f"ELASTICKV_PAGE_SIZE={self.page_size} must be a positive multiple of the "
                f"OS page size ({gran} bytes), e.g. 64K or 2M"
            )
        if not 0 <= self.hot_min_pages <= self.hot_max_pages:
            raise ElasticKVStartupError(
                "need 0 <= ELASTICKV_HOT_MIN_PAGES <= ELASTICKV_HOT_MAX_PAGES, got "
                f"{self.hot_min_pages} and {self.hot_max_pages}"
            )
        for name in ("virtual_capacity_bytes", "budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < self.page_size:
                raise ElasticKVStartupError(
                    f"{SETTINGS[name][0]}={value} is smaller than one page ({self.page_size})"
                )
        if self.instance_name is not None and not self.instance_name.strip():
            raise ElasticKVStartupError("ELASTICKV_INSTANCE must not be blank")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ElasticKVStartupError(
                f"ELASTICKV_METRICS_PORT={self.metrics_port} is not a TCP port (0-65535)"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ElasticConfig:
        """Parse ``ELASTICKV_*``; an unknown ``ELASTICKV_`` variable is an error (a typo
        would otherwise be silently ignored)."""
        env = os.environ if environ is None else environ
        known = {var for var, _ in SETTINGS.values()}
        unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in known)
        if unknown:
            raise ElasticKVStartupError(
                f"unknown elastickv setting(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}"
            )

        def get(name: str) -> str | None:
            value = env.get(SETTINGS[name][0])
            return None if value is None or not value.strip() else value

        def size(name: str) -> int | None:
            text = get(name)
            if text is None:
                return None
            try:
                return parse_size(text)
            except ValueError as exc:
                raise ElasticKVStartupError(f"{SETTINGS[name][0]}: {exc}") from None

        def count(name: str, default: int) -> int:
            text = get(name)
            if text is None:
                return default
            try:
                value = int(text)
            except ValueError:
                raise ElasticKVStartupError(
                    f"{SETTINGS[name][0]}={text!r} is not a whole number"
                ) from None
            return value

        strict_text = get("strict")
        check_text = get("check_commits")
        return cls(
            page_size=size("page_size") or DEFAULT_PAGE_SIZE,
            hot_min_pages=count("hot_min_pages", 0),
            hot_max_pages=count("hot_max_pages", 4),
            virtual_capacity_bytes=size("virtual_capacity_bytes"),
            budget_bytes=size("budget_bytes"),
            strict=True if strict_text is None else _parse_bool("ELASTICKV_STRICT", strict_text),
            instance_name=get("instance_name"),
            check_commits=check_text is not None
            and _parse_bool("ELASTICKV_CHECK_COMMITS", check_text),
            ledger_dir=get("ledger_dir"),
            metrics_port=None if get("metrics_port") is None else count("metrics_port", 0),
        )

    def resolved_virtual_capacity(self) -> int:
        """The advertised capacity: the setting, else half of this host's physical memory."""
        if self.virtual_capacity_bytes is not None:
            return self.virtual_capacity_bytes
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _parse_bool(var: str, text: str) -> bool:
    key = text.strip().lower()
    if key in _TRUE:
        return True
    if key in _FALSE:
        return False
    raise ElasticKVStartupError(f"{var}={text!r}: use 1 or 0")
