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
from elastickv.geometry.transfer import HeadSlice, RemoteSide, TransferPlan, plan_transfer
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
    p.add_argument(
        "--transfer",
        action="store_true",
        help="also show what a KV connector moves per block to/from a remote engine (P/D)",
    )
    p.add_argument("--remote-tp", type=int, default=1, help="--transfer: remote TP size (1)")
    p.add_argument("--tp", type=int, default=1, help="--transfer: local TP size (1)")
    p.add_argument("--tp-rank", type=int, default=0, help="--transfer: local rank shown (0)")
    p.add_argument(
        "--total-kv-heads",
        type=int,
        help="--transfer: the model's KV heads (default: --kv-heads x --tp)",
    )
    p.add_argument("--block", type=int, default=0, help="--transfer: block shown (0)")
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
    plan, ranks = _transfer(args, geometry) if args.transfer else (None, [])
    if args.json:
        payload = report.as_dict()
        if plan is not None:
            payload["transfer"] = {
                **plan.as_dict(args.block),
                "ranks": [[s.as_dict() for s in slices] for slices in ranks],
            }
        print(json.dumps(payload))
    else:
        console = output_console()
        render_report(report, console)
        if plan is not None:
            render_transfer(plan, ranks, args.block, console)
    return 0


def _transfer(
    args: argparse.Namespace, geometry: KVCacheGeometry
) -> tuple[TransferPlan, list[tuple[HeadSlice, ...]]]:
    """The shown rank's plan, and every local rank's head slices."""
    try:

        def plan(rank: int) -> TransferPlan:
            return plan_transfer(
                geometry,
                RemoteSide(args.remote_tp),
                local_tp=args.tp,
                local_rank=rank,
                total_kv_heads=args.total_kv_heads,
            )

        shown = plan(args.tp_rank)
        shown.transfers(args.block)
        ranks = [plan(rank).slices for rank in range(args.tp)]
    except (GeometryError, IndexError) as err:
        raise UserError(str(err)) from err
    return shown, ranks


def render_transfer(
    plan: TransferPlan, ranks: list[tuple[HeadSlice, ...]], block: int, console: Console
) -> None:
    t = plan.topology
    console.print(
        f"[bold]Transfer[/] local TP {t.local_tp} <-> remote TP {t.remote_tp}, "
        f"{t.total_kv_heads} KV heads{' (MLA latent, replicated)' if t.mla else ''}: "
        f"tp_ratio {t.tp_ratio}, local replicated {t.replicated(t.local_tp)}, "
        f"remote replicated {t.replicated(t.remote_tp)}"
    )
    slices = Table(title="Head slices per local rank (per block)", title_justify="left")
    for column in ("local rank", "remote rank", "kv heads", "local slots", "remote slots"):
        slices.add_column(column, justify="right")
    for rank_slices in ranks:
        for s in rank_slices:
            slices.add_row(
                str(s.local_rank),
                str(s.remote_rank),
                _span(s.kv_heads),
                _span(s.local_slots) + (" (whole)" if s.local_whole else ""),
                _span(s.remote_slots) + (" (whole)" if s.remote_whole else ""),
            )
    print_table(console, slices)
    transfers = plan.transfers(block)
    regions = Table(
        title=f"Regions of block {block}, local rank {plan.local_rank} (bytes of each backing)",
        title_justify="left",
    )
    for column in ("layer", "kernel block", "heads", "tokens", "remote rank"):
        regions.add_column(column, justify="right")
    for column in ("local offset", "remote offset", "length"):
        regions.add_column(column, justify="right")
    for x in transfers:
        regions.add_row(
            str(x.local.layer),
            str(x.local.kernel_block),
            _span(x.local.heads),
            _span(x.local.tokens),
            str(x.remote_rank),
            f"{x.local.offset:,}",
            f"{x.remote.offset:,}",
            f"{x.local.length:,}",
        )
    print_table(console, regions)
    console.print(
        f"{len(transfers)} regions, {sum(x.local.length for x in transfers):,} bytes per block"
    )


def _span(value: tuple[int, int]) -> str:
    return f"{value[0]}..{value[1] - 1}" if value[1] - value[0] > 1 else str(value[0])


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
