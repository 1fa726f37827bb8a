"""``elastickv layout tour``: the geometry at work on built-in models, in every layout.

For each model and layout it builds a real backing, writes a distinct value into every
block of every layer through the engine-facing views, and checks — through the geometry's
per-block byte ranges — that each block's bytes hold exactly its own value and nothing
else was written. The printed costs are for a realistic block count.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from elastickv.cli.tables import output_console, print_table
from elastickv.geometry import (
    AttentionKind,
    GeometryError,
    KVCacheGeometry,
    KVLayout,
    build_layer_views,
    vllm028_layout,
)
from elastickv.geometry.report import DEFAULT_PAGE_SIZE, explain
from elastickv.models.shapes import DEEPSEEK_V2_LITE, LLAMA3_8B, ModelShape
from elastickv.units import format_bytes

_CHECK_BLOCKS = 6  # blocks really allocated and written per case
_REPORT_BLOCKS = 4096  # blocks the printed costs assume


@dataclass(frozen=True)
class Case:
    label: str
    overrides: dict[str, object]


def cases() -> list[Case]:
    """Every layout of both contracts, plus a split-kernel and a quantized variant."""
    out = [Case(f"0.32 {m.name}", {"layout": m, "contract": "0.32"}) for m in KVLayout]
    for name in ("NHD", "HND"):
        for cross in (False, True):
            layout = vllm028_layout(name, cross_layer=cross)
            label = f"0.28 {name}{' cross-layer' if cross else ''}"
            out.append(Case(label, {"layout": layout, "contract": "0.28"}))
    out.append(Case("0.32 HND kernel 8", {"layout": "HND", "kernel_block_size": 8}))
    out.append(
        Case("0.28 NHD split K/V", {"kind": "split_kv", "layout": "NHD", "contract": "0.28"})
    )
    out.append(Case("0.32 HND fp8", {"layout": "HND", "kv_cache_dtype": "fp8"}))
    return out


def register(layout_commands: Any) -> None:
    """``tour`` under ``elastickv layout``."""
    p = layout_commands.add_parser(
        "tour",
        help="run the geometry on built-in models in every layout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-dir", type=Path, help="where to build the tiny test models")
    p.add_argument("--json", action="store_true", help="print results as JSON lines")
    p.set_defaults(run=run_tour)


def run_tour(args: argparse.Namespace) -> int:
    console = output_console()
    shapes = [LLAMA3_8B, DEEPSEEK_V2_LITE, *_tiny_model_shapes(args.model_dir, console)]
    failures = 0
    for shape in shapes:
        rows = [_run_case(shape, case) for case in _cases_for(shape)]
        failures += sum(not r["ok"] for r in rows)
        if args.json:
            for row in rows:
                print(json.dumps({"model": shape.name, **row}))
        else:
            _render(console, shape, rows)
    if not args.json:
        status = "[green]all checks passed[/]" if not failures else f"[red]{failures} failed[/]"
        console.print(status)
    return 1 if failures else 0


def _tiny_model_shapes(model_dir: Path | None, console: Console) -> list[ModelShape]:
    """Build (or reuse) the tiny models and read their shape back from config.json."""
    from elastickv.models.tiny import BUILTIN_MODELS, default_cache_dir, ensure_tiny_model

    shapes = []
    for name, spec in BUILTIN_MODELS.items():
        start = time.perf_counter()
        path = ensure_tiny_model(spec, model_dir or default_cache_dir())
        config = json.loads((path / "config.json").read_text())
        console.print(
            f"tiny model [bold]{name}[/] ready at {path} ({time.perf_counter() - start:.1f} s)"
        )
        shapes.append(
            ModelShape(
                name,
                num_layers=config["num_hidden_layers"],
                num_kv_heads=config["num_key_value_heads"],
                head_size=config["head_dim"],
                dtype=config["torch_dtype"],
            )
        )
    return shapes


def _cases_for(shape: ModelShape) -> list[Case]:
    if shape.kind is AttentionKind.MLA:
        return [
            Case("0.32 LBHNC (MLA)", {"layout": "LBHNC"}),
            Case("0.32 BLHNC (MLA)", {"layout": "BLHNC"}),
            Case("0.28 MLA", {"layout": "LBHNC", "contract": "0.28"}),
        ]
    return cases()


def _run_case(shape: ModelShape, case: Case) -> dict[str, Any]:
    try:
        check = shape.geometry(_CHECK_BLOCKS, **case.overrides)
        report = explain(shape.geometry(_REPORT_BLOCKS, **case.overrides), DEFAULT_PAGE_SIZE)
    except GeometryError as err:
        return {"case": case.label, "ok": False, "error": str(err)}
    ok = verify_block_isolation(check)
    view = report.layers[0]
    return {
        "case": case.label,
        "ok": ok,
        "view_shape": list(view.shape),
        "view_stride": list(view.stride),
        "block_bytes_per_layer": report.block_bytes_per_layer,
        "block_stride": report.block_stride,
        "blocks_per_page": report.blocks_per_page,
        "pages_per_block": report.pages_per_block,
        "virtual_bytes": report.backing_bytes,
        "warnings": report.warnings,
    }


def verify_block_isolation(geometry: KVCacheGeometry) -> bool:
    """Write block ``b``'s value ``b + 1`` through every layer's view; read it back by bytes."""
    backing = torch.zeros(geometry.backing_bytes, dtype=torch.uint8)
    views = build_layer_views(geometry, backing)
    ratio = geometry.kernel_ratio
    block_dim = 1 if geometry.kind is AttentionKind.SPLIT_KV else 0
    for view in views:
        for block in range(geometry.num_blocks):
            blocks = view.narrow(block_dim, block * ratio, ratio)
            blocks.copy_(torch.full_like(blocks, block + 1))
    expected = torch.zeros_like(backing)
    for block in range(geometry.num_blocks):
        marker = torch.full((), block + 1, dtype=geometry.storage_dtype).view(-1).view(torch.uint8)
        for start, end in geometry.block_byte_ranges(block):
            expected[start:end] = marker.repeat((end - start) // marker.numel())
    return bool(torch.equal(backing, expected))


def _render(console: Console, shape: ModelShape, rows: list[dict[str, Any]]) -> None:
    table = Table(
        title=f"{shape.name}: {shape.num_layers} layers, {shape.num_kv_heads} KV heads, "
        f"head {shape.head_size}, {shape.dtype}, {_REPORT_BLOCKS} blocks of {shape.block_size} "
        "tokens; every case written and read back for real",
        title_justify="left",
    )
    for column in (
        "layout",
        "layer-0 view shape",
        "stride",
        "block/layer",
        "block stride",
        "blocks/page",
        "pages/block",
        "check",
    ):
        table.add_column(column, justify="left" if column == "layout" else "right", no_wrap=True)
    for row in rows:
        if "error" in row:
            table.add_row(row["case"], f"[red]{row['error']}[/]", *[""] * 5, "[red]x[/]")
            continue
        flag = " [yellow]![/]" if row["warnings"] else ""
        table.add_row(
            row["case"] + flag,
            "x".join(map(str, row["view_shape"])),
            ",".join(map(str, row["view_stride"])),
            format_bytes(row["block_bytes_per_layer"]),
            format_bytes(row["block_stride"]),
            f"{row['blocks_per_page']:.3g}",
            str(row["pages_per_block"]),
            "[green]ok[/]" if row["ok"] else "[red]FAIL[/]",
        )
    print_table(console, table)
    seen: set[str] = set()
    for row in rows:
        for warning in row.get("warnings", []):
            key = warning.split(" ")[0]
            if key not in seen:
                seen.add(key)
                console.print(f"[yellow]! {row['case']}:[/] {warning}")
