"""Every ``ELASTICKV_*`` setting, parsed and validated in one place into a frozen config.

Why one place: the plugin runs in every vLLM process (API server, engine core, workers),
and each must read the same settings the same way. Errors echo what the user typed, in
their units, and say what would be accepted.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastickv.control.limits import parse_limit
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.transfer.kv_read_hold import DEFAULT_HOLD_S
from elastickv.integrations.vllm.transfer.nixl_progress import MAX_WAIT_MS
from elastickv.units import format_bytes, parse_size
from elastickv.vmm import DEFAULT_PAGE_SIZE, host_granularity
from elastickv.vmm.host import largest_reservation

ENABLE_VAR = "ELASTICKV"
PREFIX = "ELASTICKV_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
MAX_READ_HOLD_S = 86400.0  # a day: beyond that, blocks a decoder never reads are a leak

# Setting name -> (variable, help) — the documented surface (docs/vllm.md mirrors it).
SETTINGS: dict[str, tuple[str, str]] = {
    "page_size": ("ELASTICKV_PAGE_SIZE", "bytes committed/released at a time (default 2M)"),
    "hot_min_pages": ("ELASTICKV_HOT_MIN_PAGES", "pages kept committed while idle (default 0)"),
    "hot_max_pages": ("ELASTICKV_HOT_MAX_PAGES", "freed pages kept for reuse (default 4)"),
    "virtual_capacity_bytes": (
        "ELASTICKV_VIRTUAL_CAPACITY",
        "most KV capacity advertised to vLLM (default: half of physical memory; never more "
        "than max-num-seqs requests of max-model-len tokens)",
    ),
    "budget_bytes": (
        "ELASTICKV_BUDGET",
        "most physical KV bytes this engine may commit: 2G, 30% (of the device budget) or none",
    ),
    "strict": (
        "ELASTICKV_STRICT",
        "1: uncommitted pages fault on any access; 0: they read as zeros (default: 1 on the "
        "host, 0 on a GPU, where a fault kills the engine's CUDA context)",
    ),
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
    "kv_read_hold_s": (
        "ELASTICKV_KV_READ_HOLD",
        "P/D: seconds a prefill engine keeps blocks its decoder has not read past vLLM's "
        "KV lease (default 300; 0: the lease only)",
    ),
    "nixl_progress_wait_ms": (
        "ELASTICKV_NIXL_PROGRESS_WAIT_MS",
        "P/D: NIXL's progress thread waits for events, at most this many ms, instead of "
        "spinning on a core; 0: NIXL's spin (default 5 on vLLM's CPU backend, else 0)",
    ),
    "sleep_level": (
        "ELASTICKV_SLEEP_LEVEL",
        "on a GPU, the vLLM sleep level an asleep engine's weights get: 1, offloaded to host "
        "memory (default), or 2, discarded and reloaded from the checkpoint on wake",
    ),
}
# Read by the plugin whether or not ``ELASTICKV=1`` (a native engine's scheduler can be clocked
# too); not an engine setting (see ``scheduler_clock``).
SCHEDULER_CLOCK_VAR = "ELASTICKV_SCHEDULER_CLOCK"
KNOWN_VARIABLES = frozenset(var for var, _ in SETTINGS.values()) | {SCHEDULER_CLOCK_VAR}


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True only for an explicit opt-in; an unparsable value is an error, not a silent no."""
    env = os.environ if environ is None else environ
    return _parse_bool(ENABLE_VAR, env.get(ENABLE_VAR, "0"))


def ignored_settings(environ: Mapping[str, str] | None = None) -> list[str]:
    """``ELASTICKV_*`` variables that are set while the plugin is off: vLLM runs natively and
    they change nothing, which a user who set them wants to know."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith(PREFIX) and k != SCHEDULER_CLOCK_VAR)


def unknown_setting_message(names: list[str]) -> str:
    """ "unknown setting …; did you mean …?" for mistyped ``ELASTICKV_*`` variables."""
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, sorted(KNOWN_VARIABLES), n=1, cutoff=0.6)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return (
        f"unknown elastickv setting(s) {', '.join(hints)}; known: "
        f"{', '.join(sorted(KNOWN_VARIABLES))}"
    )


@dataclass(frozen=True)
class ElasticConfig:
    """The plugin's settings for one engine. Construct via :meth:`from_env`.

    ``budget_bytes`` / ``budget_percent``: at most one is set (``ELASTICKV_BUDGET=2G`` or
    ``=30%``, a share of the device budget resolved when the engine registers)."""

    page_size: int = DEFAULT_PAGE_SIZE
    hot_min_pages: int = 0
    hot_max_pages: int = 4
    virtual_capacity_bytes: int | None = None
    budget_bytes: int | None = None
    strict: bool | None = None  # None: the device's default (host: strict; GPU: zero page)
    instance_name: str | None = None
    check_commits: bool = False
    ledger_dir: str | None = None
    metrics_port: int | None = None
    budget_percent: float | None = None
    kv_read_hold_s: float = DEFAULT_HOLD_S
    nixl_progress_wait_ms: int | None = None  # None: the platform's default
    sleep_level: int = 1
    # What the user typed, by setting name, so errors echo it (not part of equality).
    typed: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        gran = host_granularity()
        if self.page_size <= 0 or self.page_size % gran:
            raise ElasticKVStartupError(
                f"{self.shown('page_size', self.page_size)} must be a positive multiple of "
                f"the OS page size ({format_bytes(gran)}), e.g. 64K or 2M"
            )
        if not 0 <= self.hot_min_pages <= self.hot_max_pages:
            raise ElasticKVStartupError(
                "need 0 <= ELASTICKV_HOT_MIN_PAGES <= ELASTICKV_HOT_MAX_PAGES, got "
                f"{self.hot_min_pages} and {self.hot_max_pages}"
            )
        if self.budget_bytes is not None and self.budget_percent is not None:
            raise ElasticKVStartupError("set ELASTICKV_BUDGET as a size or a percentage, not both")
        if self.budget_percent is not None and not 0 < self.budget_percent <= 100:
            raise ElasticKVStartupError(
                f"{self.shown('budget_bytes', f'{self.budget_percent}%')}: a percentage of the "
                "device budget must be above 0% and at most 100%"
            )
        for name in ("virtual_capacity_bytes", "budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < self.page_size:
                raise ElasticKVStartupError(
                    f"{self.shown(name, value)} is smaller than one page "
                    f"({self.shown('page_size', self.page_size)}): set at least "
                    f"{format_bytes(self.page_size)}"
                )
        if self.virtual_capacity_bytes is not None:
            self._check_reservable(self.virtual_capacity_bytes)
        if self.instance_name is not None and not self.instance_name.strip():
            raise ElasticKVStartupError("ELASTICKV_INSTANCE must not be blank")
        if not 0 <= self.kv_read_hold_s <= MAX_READ_HOLD_S:
            raise ElasticKVStartupError(
                f"{self.shown('kv_read_hold_s', f'{self.kv_read_hold_s:g}')} must be a number "
                f"of seconds from 0 to {MAX_READ_HOLD_S:g}, e.g. 300"
            )
        wait_ms = self.nixl_progress_wait_ms
        if wait_ms is not None and not 0 <= wait_ms <= MAX_WAIT_MS:
            raise ElasticKVStartupError(
                f"{self.shown('nixl_progress_wait_ms', str(wait_ms))} must be a "
                f"whole number of milliseconds from 0 to {MAX_WAIT_MS}, e.g. 5 (0: NIXL's "
                "own spinning progress thread)"
            )
        if self.sleep_level not in (1, 2):
            raise ElasticKVStartupError(
                f"{self.shown('sleep_level', str(self.sleep_level))} must be 1 (weights "
                "offloaded to host memory) or 2 (discarded, reloaded on wake)"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ElasticKVStartupError(
                f"ELASTICKV_METRICS_PORT={self.metrics_port} is not a TCP port (0-65535)"
            )

    def shown(self, name: str, value: int | str) -> str:
        """``VAR=<as typed> (<in units>)`` for an error message."""
        var = SETTINGS[name][0]
        text = self.typed.get(name)
        if isinstance(value, int):
            units = format_bytes(value)
            if text is None:
                return f"{var}={units}"
            return f"{var}={text}" if text.strip() == units else f"{var}={text} ({units})"
        return f"{var}={text if text is not None else value}"

    def _check_reservable(self, size: int) -> None:
        most = largest_reservation(size)
        if most < size:
            raise ElasticKVStartupError(
                f"{self.shown('virtual_capacity_bytes', size)} cannot be reserved on this "
                f"host: the largest address range it can reserve now is about "
                f"{format_bytes(most)}; set ELASTICKV_VIRTUAL_CAPACITY at most that, or leave "
                "it unset (half of physical memory)"
            )

    @property
    def budget_spec(self) -> int | str | None:
        """``ELASTICKV_BUDGET`` as the ledger takes a limit: bytes, ``"30%"``, or None."""
        if self.budget_percent is not None:
            return f"{self.budget_percent}%"
        return self.budget_bytes

    def budget_text(self) -> str:
        """The budget for a log line: ``2.0 GiB``, ``30% of the device budget`` or ``none``."""
        if self.budget_percent is not None:
            return f"{self.budget_percent:g}% of the device budget"
        return "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ElasticConfig:
        """Parse ``ELASTICKV_*``; an unknown ``ELASTICKV_`` variable is an error (a typo
        would otherwise be silently ignored)."""
        env = os.environ if environ is None else environ
        unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in KNOWN_VARIABLES)
        if unknown:
            raise ElasticKVStartupError(unknown_setting_message(unknown))

        typed: dict[str, str] = {}

        def get(name: str) -> str | None:
            value = env.get(SETTINGS[name][0])
            if value is None or not value.strip():
                return None
            typed[name] = value.strip()
            return value

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

        def seconds(name: str, default: float) -> float:
            text = get(name)
            if text is None:
                return default
            try:
                value = float(text.strip().removesuffix("s"))
            except ValueError:
                raise ElasticKVStartupError(
                    f"{SETTINGS[name][0]}={text!r} is not a number of seconds, e.g. 300"
                ) from None
            if value != value:  # NaN
                raise ElasticKVStartupError(f"{SETTINGS[name][0]}={text!r} is not a number")
            return value

        budget_bytes, budget_percent = _budget(get("budget_bytes"))
        strict_text = get("strict")
        check_text = get("check_commits")
        wait_text = get("nixl_progress_wait_ms")
        return cls(
            page_size=size("page_size") or DEFAULT_PAGE_SIZE,
            hot_min_pages=count("hot_min_pages", 0),
            hot_max_pages=count("hot_max_pages", 4),
            virtual_capacity_bytes=size("virtual_capacity_bytes"),
            budget_bytes=budget_bytes,
            budget_percent=budget_percent,
            strict=None if strict_text is None else _parse_bool("ELASTICKV_STRICT", strict_text),
            instance_name=get("instance_name"),
            check_commits=check_text is not None
            and _parse_bool("ELASTICKV_CHECK_COMMITS", check_text),
            ledger_dir=get("ledger_dir"),
            metrics_port=None if get("metrics_port") is None else count("metrics_port", 0),
            kv_read_hold_s=seconds("kv_read_hold_s", DEFAULT_HOLD_S),
            nixl_progress_wait_ms=None if wait_text is None else count("nixl_progress_wait_ms", 0),
            sleep_level=count("sleep_level", 1),
            typed=typed,
        )

    def resolved_virtual_capacity(self) -> int:
        """The advertised capacity: the setting, else half of this host's physical memory."""
        if self.virtual_capacity_bytes is not None:
            return self.virtual_capacity_bytes
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _budget(text: str | None) -> tuple[int | None, float | None]:
    """``ELASTICKV_BUDGET`` in the grammar of ``elastickv limit``: a size, ``N%`` or none."""
    if text is None:
        return None, None
    stripped = text.strip()
    try:
        if stripped.endswith("%"):
            parse_limit(stripped, 100)  # the syntax and the 0..100 range
            return None, float(stripped[:-1])
        return parse_limit(stripped, 0), None
    except ValueError as exc:
        raise ElasticKVStartupError(f"ELASTICKV_BUDGET: {exc}") from None


def _parse_bool(var: str, text: str) -> bool:
    key = text.strip().lower()
    if key in _TRUE:
        return True
    if key in _FALSE:
        return False
    raise ElasticKVStartupError(f"{var}={text!r}: use 1 or 0")
