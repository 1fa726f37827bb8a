"""The defaults table of docs/serve.md is what the code does: every setting's default, and what
``elastickv serve`` with no ``--config`` or ``--model`` uses, read from the page and compared
with a configuration built with nothing set."""

from __future__ import annotations

import re
from pathlib import Path

from elastickv.serve import config as serve_config
from elastickv.serve.config import (
    ModelConfig,
    ServeConfig,
    builtin_config,
    config_from_mapping,
    default_min_kv,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "serve.md"
UNITS = ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K"))


def table() -> dict[str, tuple[str, str, str]]:
    """setting -> (flag, default, no --config / --model), from the page."""
    text = PAGE.read_text()
    section = text.split("### Defaults", 1)[1].split("\n\n| setting")[1]
    rows = {}
    for line in section.split("\n\n")[0].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = (cells[1], cells[2], cells[3])
    return rows


def first(cell: str) -> str:
    """The value a cell starts with: its first `code`, else its first word."""
    match = re.match(r"`([^`]*)`", cell)
    return match.group(1) if match else cell.split()[0].strip(",;:")


def size(nbytes: int) -> str:
    return next(f"{nbytes // unit}{suffix}" for unit, suffix in UNITS if nbytes % unit == 0)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    return f"{seconds / 60:g}m" if seconds % 60 == 0 else f"{seconds:g}s"


def described(config: ServeConfig, model: ModelConfig) -> dict[str, str]:
    """What a configuration does for each setting, in the table's words."""
    return {
        "[router] host": config.host,
        "[router] port": str(config.port),
        "[router] queue_limit": str(config.queue_limit),
        "[router] wake_timeout": duration(config.wake_timeout_s),
        "[router] api_key_file": "none" if config.api_key is None else config.api_key.source,
        "[router] allow_unauthenticated": str(config.allow_unauthenticated).lower(),
        "[router] models_api": str(config.models_api).lower(),
        "[device] budget": size(config.budget),
        "[device] page_size": size(config.page_size),
        "[device] mode": config.mode,
        "[device] hot_max_pages": str(config.hot_max_pages),
        "min_kv": size(model.min_kv),
        "max_kv": "the" if model.max_kv is None else size(model.max_kv),
        "priority": str(model.priority),
        "pinned": str(model.pinned).lower(),
        "release_after": duration(model.release_after_s),
        "sleep_after": duration(model.sleep_after_s),
        "stop_after": duration(model.stop_after_s),
        "args": " ".join(model.args) or "none",
        "log_dir": "a" if config.log_dir is None else config.log_dir,
        "python": "found" if config.python is None else config.python,
    }


def test_the_defaults_table_is_what_the_code_does() -> None:
    rows = table()
    # Nothing set but the required budget, on a budget large enough for the 64M cap to bind.
    plain = config_from_mapping(
        {"device": {"budget": "1G"}, "model": [{"model": "tiny-llama"}]}, source="t"
    )
    plain_model = plain.models[0]
    builtin = builtin_config()
    defaults = described(plain, plain_model)
    defaults["[device] budget"] = "required"
    no_arguments = described(builtin, builtin.models[0])
    assert set(rows) == set(defaults), set(rows) ^ set(defaults)
    for setting, (_, default, without_arguments) in rows.items():
        assert first(default) == defaults[setting], (setting, default)
        same = without_arguments == "the same"
        assert same or first(without_arguments) == no_arguments[setting], setting
    assert plain_model.min_kv == serve_config.DEFAULT_MIN_KV
    assert default_min_kv(8 << 20, 2, 64 << 10) == 4 << 20  # "the budget's even share"
    assert plain.cap_of(plain_model) == plain.budget  # "the budget minus the others' min_kv"
    # A pinned model's stop_after, and the dtype a built-in model is given.
    assert "(`never` when pinned)" in rows["stop_after"][1]
    pinned = config_from_mapping(
        {"device": {"budget": "1G"}, "model": [{"model": "tiny-llama", "pinned": True}]},
        source="t",
    )
    assert pinned.models[0].stop_after_s is None
    assert "--dtype" in rows["args"][1]


def test_the_flags_column_names_real_flags() -> None:
    import subprocess
    import sys

    serve_help = subprocess.run(
        [sys.executable, "-m", "elastickv.cli.main", "serve", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    flags = [flag.strip("`") for flag, _, _ in table().values() if flag != "–"]
    assert len(flags) == 11
    for flag in flags:
        assert re.search(rf"^\s+{re.escape(flag)}\b", serve_help, re.MULTILINE), flag
