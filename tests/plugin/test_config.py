"""``ELASTICKV_*`` settings without vLLM: one grammar with ``elastickv limit``, errors that
echo what was typed in the user's units, capacities checked against what the host can
reserve, typos caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastickv.integrations.vllm.config import SETTINGS, ElasticConfig, ignored_settings
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.vmm.host import largest_reservation

TiB = 1 << 40


@pytest.mark.parametrize(
    ("text", "size", "percent", "spec"),
    [
        ("2G", 2 << 30, None, 2 << 30),
        ("512MiB", 512 << 20, None, 512 << 20),
        ("30%", None, 30.0, "30.0%"),
        ("12.5 %", None, 12.5, "12.5%"),
        ("none", None, None, None),
    ],
)
def test_budget_takes_the_limit_grammar(
    text: str, size: int | None, percent: float | None, spec: int | str | None
) -> None:
    config = ElasticConfig.from_env({"ELASTICKV_BUDGET": text})
    assert (config.budget_bytes, config.budget_percent, config.budget_spec) == (
        size,
        percent,
        spec,
    )


def test_read_hold_takes_seconds() -> None:
    assert ElasticConfig.from_env({}).kv_read_hold_s == 300.0
    assert ElasticConfig.from_env({"ELASTICKV_KV_READ_HOLD": "45"}).kv_read_hold_s == 45.0
    assert ElasticConfig.from_env({"ELASTICKV_KV_READ_HOLD": "2.5s"}).kv_read_hold_s == 2.5
    assert ElasticConfig.from_env({"ELASTICKV_KV_READ_HOLD": "0"}).kv_read_hold_s == 0.0


def test_every_setting_is_in_the_settings_table_of_the_docs() -> None:
    table = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    missing = [var for var, _ in SETTINGS.values() if f"| `{var}` |" not in table]
    assert missing == [], f"docs/vllm.md has no row for {missing}"


def test_nixl_progress_wait_takes_milliseconds() -> None:
    assert ElasticConfig.from_env({}).nixl_progress_wait_ms is None  # the platform's default
    assert (
        ElasticConfig.from_env({"ELASTICKV_NIXL_PROGRESS_WAIT_MS": "0"}).nixl_progress_wait_ms == 0
    )
    env = {"ELASTICKV_NIXL_PROGRESS_WAIT_MS": "5"}
    assert ElasticConfig.from_env(env).nixl_progress_wait_ms == 5


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"ELASTICKV_BUDGET": "1048576"},
            "ELASTICKV_BUDGET=1048576 (1.0 MiB) is smaller than one page (ELASTICKV_PAGE_SIZE="
            "2.0 MiB): set at least 2.0 MiB",
        ),
        (
            {"ELASTICKV_BUDGET": "1M", "ELASTICKV_PAGE_SIZE": "2M"},
            "ELASTICKV_BUDGET=1M (1.0 MiB) is smaller than one page (ELASTICKV_PAGE_SIZE=2M "
            "(2.0 MiB))",
        ),
        ({"ELASTICKV_BUDGET": "120%"}, "a percentage must be between 0% and 100%"),
        ({"ELASTICKV_BUDGET": "0%"}, "must be above 0%"),
        ({"ELASTICKV_BUDGET": "lots"}, "use a size (512M, 2G, 2GiB), a percentage"),
        ({"ELASTICKV_PAGE_SIZE": "1000"}, "ELASTICKV_PAGE_SIZE=1000 (1000 B) must be a positive"),
        ({"ELASTICKV_BUGDET": "2G"}, "ELASTICKV_BUGDET (did you mean ELASTICKV_BUDGET?)"),
        ({"ELASTICKV_KV_READ_HOLD": "long"}, "ELASTICKV_KV_READ_HOLD='long' is not a number"),
        ({"ELASTICKV_KV_READ_HOLD": "-5"}, "ELASTICKV_KV_READ_HOLD=-5 must be a number of"),
        ({"ELASTICKV_KV_READ_HOLD": "nan"}, "ELASTICKV_KV_READ_HOLD='nan' is not a number"),
        ({"ELASTICKV_KV_READ_HOLD": "inf"}, "from 0 to 86400"),
        ({"ELASTICKV_NIXL_PROGRESS_WAIT_MS": "5ms"}, "='5ms' is not a whole number"),
        (
            {"ELASTICKV_NIXL_PROGRESS_WAIT_MS": "-1"},
            "ELASTICKV_NIXL_PROGRESS_WAIT_MS=-1 must be a whole number of milliseconds from 0 "
            "to 1000",
        ),
        ({"ELASTICKV_NIXL_PROGRESS_WAIT_MS": "5000"}, "=5000 must be a whole number"),
    ],
)
def test_errors_echo_the_setting_as_typed(env: dict[str, str], message: str) -> None:
    with pytest.raises(ElasticKVStartupError) as caught:
        ElasticConfig.from_env(env)
    assert message in str(caught.value)


def test_virtual_capacity_beyond_the_address_space_is_refused_up_front() -> None:
    """100T was accepted and failed 38 s later in the worker with a bare ENOMEM; it is now
    refused when the settings are read, naming the variable, the size and the most that
    fits (if this host can reserve 100T, ask for more than it can)."""
    ask = 100 * TiB if largest_reservation(100 * TiB) < 100 * TiB else 1 << 60
    text = "100T" if ask == 100 * TiB else str(ask)
    with pytest.raises(ElasticKVStartupError) as caught:
        ElasticConfig.from_env({"ELASTICKV_VIRTUAL_CAPACITY": text})
    message = str(caught.value)
    assert message.startswith(f"ELASTICKV_VIRTUAL_CAPACITY={text} (")
    assert "cannot be reserved on this host" in message and "at most that" in message
    assert ElasticConfig.from_env({"ELASTICKV_VIRTUAL_CAPACITY": "8G"}).virtual_capacity_bytes


def test_largest_reservation_is_a_real_bound() -> None:
    most = largest_reservation(1 << 60)
    assert 0 < most < 1 << 60
    assert largest_reservation(most) == most  # what it reports can be reserved
    assert largest_reservation(4096) == 4096


def test_settings_set_while_the_plugin_is_off_are_reported() -> None:
    assert ignored_settings({"ELASTICKV_BUGDET": "2G", "PATH": "/bin"}) == ["ELASTICKV_BUGDET"]
    assert ignored_settings({"PATH": "/bin"}) == []


def test_the_scheduler_clock_is_known_and_works_while_the_plugin_is_off() -> None:
    clock = {"ELASTICKV_SCHEDULER_CLOCK": "/run/engine.clock"}
    assert ignored_settings(clock) == []  # it clocks a native engine: not ignored
    ElasticConfig.from_env(clock)  # and no "unknown setting" for an elastic engine


def test_a_percentage_budget_without_the_ledger_is_of_physical_memory() -> None:
    import os

    from elastickv.alloc import FixedBudget
    from elastickv.integrations.vllm.scheduler.store import local_policy

    policy = local_policy(ElasticConfig.from_env({"ELASTICKV_BUDGET": "25%"}), "host")
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert isinstance(policy, FixedBudget)
    assert policy.available_bytes() == physical // 4


def test_the_retired_precommit_setting_is_refused_not_ignored() -> None:
    """``ELASTICKV_PRECOMMIT`` is gone (the scheduler grants pages and the workers map them,
    so no commit waits in the scheduler): an engine started with it is told, never left
    believing it acts."""
    with pytest.raises(ElasticKVStartupError, match="ELASTICKV_PRECOMMIT"):
        ElasticConfig.from_env({"ELASTICKV_PRECOMMIT": "1"})
