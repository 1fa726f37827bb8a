"""``elastickv layout explain``: the views and page costs of a described KV cache."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from elastickv.cli.errors import UserError
from elastickv.cli.tables import output_console, print_table
from elastickv.geometry import (
    KV_CACHE_DTYPES,
    LAYOUT_NAMES,
    AttentionKind,
    Contract,
    GeometryError,
    KVCacheGeometry,
    vllm028_layout,
)
from elastickv.geometry.report import DEFAULT_PAGE_SIZE, LayoutReport, explain
from elastickv.models.shapes import example_shapes
from elastickv.units import format_bytes, parse_size


def _size(text: str) -> int:
    """argparse type for byte sizes that keeps :func:`parse_size`'s explanation."""
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def register(commands: Any) -> None:
    group = commands.add_parser("layout", help="inspect KV-cache layouts")
    sub = group.add_subparsers(dest="layout_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser(
        "explain",
        help="print per-layer views and per-block page costs of a KV cache",
        description="Print the engine-facing view of every layer and what one block costs "
        "in mapped pages. Describe the model with --model and/or the shape flags.",
    )
    p.add_argument("--model", choices=sorted(example_shapes()), help="start from a built-in shape")
    p.add_argument("--layers", type=int, help="number of attention layers")
    p.add_argument("--kv-heads", type=int, help="KV heads (head slots) per rank")
    p.add_argument("--head-size", type=int, help="K head size (MLA: latent size)")
    p.add_argument("--head-size-v", type=int, help="V head size (default: --head-size)")
    p.add_argument("--block-size", type=int, help="tokens per logical block (default 16)")
    p.add_argument("--kernel-block-size", type=int, help="tokens per kernel block")
    p.add_argument("--num-blocks", type=int, default=1024, help="logical blocks (default 1024)")
    p.add_argument("--dtype", help="model dtype: float16, bfloat16, float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--kind", choices=[k.value for k in AttentionKind], help="tensor shape family")
    p.add_argument("--contract", choices=[c.value for c in Contract], default="0.32")
    p.add_argument("--layout", default=None, help=f"one of {', '.join(LAYOUT_NAMES)} (default HND)")
    p.add_argument(
        "--cross-layer",
        action="store_true",
        help="0.28 contract: one backing for all layers (NHD/HND with the layer dimension)",
    )
    p.add_argument("--page-size-padded", type=_size, help="bytes per padded page")
    p.add_argument("--offset", type=_size, default=0, help="KVCacheTensor offset (bytes)")
    p.add_argument("--layer-stride", type=_size, help="KVCacheTensor layer_stride (bytes)")
    p.add_argument("--block-stride", type=_size, help="KVCacheTensor block_stride (bytes)")
    p.add_argument("--page-size", type=_size, default=DEFAULT_PAGE_SIZE, help="mapping page (2M)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_explain)
    from elastickv.cli import layout_tour

    layout_tour.register(sub)


def geometry_from_args(args: argparse.Namespace) -> KVCacheGeometry:
    """Combine ``--model`` with the explicit flags; flags win."""
    shape = example_shapes()[args.model] if args.model else None

    def pick(flag: str, attr: str, default: object = None) -> Any:
        value = getattr(args, flag)
        if value is not None:
            return value
        if shape is not None:
            return getattr(shape, attr)
        if default is None:
            raise UserError(f"--{flag.replace('_', '-')} is required without --model")
        return default

    kind = AttentionKind.parse(args.kind) if args.kind else pick("kind", "kind", "packed")
    layout_name = args.layout or "HND"
    if args.cross_layer:
        if args.contract != Contract.V028.value:
            raise UserError("--cross-layer is a 0.28-contract flag; under 0.32 name the layout")
        try:
            layout_name = vllm028_layout(layout_name, cross_layer=True).name
        except GeometryError as err:
            raise UserError(str(err)) from err
    if AttentionKind.parse(kind) in (AttentionKind.SPLIT_KV, AttentionKind.SPLIT_KV_BLOCK_FIRST):
        layout_name = args.layout or "NHD"
    try:
        return KVCacheGeometry(
            num_layers=pick("layers", "num_layers"),
            num_blocks=args.num_blocks,
            num_kv_heads=pick("kv_heads", "num_kv_heads"),
            block_size=pick("block_size", "block_size", 16),
            head_size=pick("head_size", "head_size"),
            head_size_v=args.head_size_v,
            dtype=pick("dtype", "dtype", "float16"),
            kv_cache_dtype=args.kv_cache_dtype,
            layout=layout_name,
            kind=kind,
            kernel_block_size=args.kernel_block_size,
            page_size_padded=args.page_size_padded,
            offset=args.offset,
            layer_stride=args.layer_stride,
            block_stride=args.block_stride,
            contract=args.contract,
        )
    except GeometryError as err:
        raise UserError(str(err)) from err


def run_explain(args: argparse.Namespace) -> int:
    geometry = geometry_from_args(args)
    try:
        report = explain(geometry, page_size=args.page_size)
    except ValueError as err:
        raise UserError(str(err)) from err
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        render_report(report, output_console())
    return 0


def render_report(report: LayoutReport, console: Console) -> None:
    g = report.geometry
    d = report.as_dict()
    console.print(
        f"[bold]{d['kind']}[/] KV cache, layout [bold]{d['layout']}[/] (vLLM {d['contract']} "
        f"contract), {g.num_layers} layers x {g.num_blocks} blocks of {g.block_size} tokens "
        f"(kernel blocks of {g.kernel_block_size}), kv_cache_dtype {d['kv_cache_dtype']}"
    )
    views = Table(title="Engine-facing view per layer (elements)", title_justify="left")
    for column in ("layer", "shape", "stride", "storage_offset", "dtype"):
        views.add_column(column, justify="right" if column != "dtype" else "left")
    for index, view in enumerate(report.layers):
        views.add_row(
            str(index),
            str(tuple(view.shape)),
            str(tuple(view.stride)),
            str(view.storage_offset),
            str(view.dtype).removeprefix("torch."),
        )
    print_table(console, views)
    facts = Table(title="Per-block cost", title_justify="left", show_header=False)
    facts.add_column("fact")
    facts.add_column("value", justify="right")
    rows = [
        ("backing bytes", format_bytes(report.backing_bytes)),
        ("bytes per block per layer", f"{report.block_bytes_per_layer:,}"),
        ("padded bytes per block per layer", f"{report.padded_block_bytes_per_layer:,}"),
        ("block stride (bytes)", f"{report.block_stride:,}"),
        ("layer stride (bytes)", f"{report.layer_stride:,}"),
        ("byte runs per block per layer", str(report.runs_per_block_per_layer)),
        (
            f"blocks sharing one {format_bytes(report.page_size)} page",
            f"{report.blocks_per_page:g}",
        ),
        ("pages one block touches (all layers)", str(report.pages_per_block)),
    ]
    for name, value in rows:
        facts.add_row(name, value)
    print_table(console, facts)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
