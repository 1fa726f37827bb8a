"""``elastickv models``: the built-in tiny models, their shapes and where they are built."""

from __future__ import annotations

import argparse
import difflib
import json
from typing import Any

from rich.table import Table

from elastickv.cli.errors import UserError
from elastickv.cli.tables import output_console, print_table
from elastickv.units import format_bytes


def register(commands: Any) -> None:
    p = commands.add_parser(
        "models",
        help="the built-in tiny models: shapes, paths, vLLM arguments",
        description="The built-in tiny models (random weights, a local tokenizer; nothing is "
        "downloaded) that `elastickv serve` serves by name: their shapes, the KV bytes a token "
        "takes, where each is built (ELASTICKV_MODEL_CACHE, else ~/.cache/elastickv/models) "
        "and the vLLM arguments that run it in its own dtype. With --path NAME: build that "
        "model if needed and print its directory alone, for vLLM's --model.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--path", metavar="NAME", help="build NAME if needed and print only its directory"
    )
    p.set_defaults(run=run_models)


def run_models(args: argparse.Namespace) -> int:
    from elastickv.models import BUILTIN_MODELS, ensure_tiny_model

    if args.path is not None:
        if args.path not in BUILTIN_MODELS:
            close = difflib.get_close_matches(args.path, list(BUILTIN_MODELS), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(
                f"no built-in model {args.path!r}; built-in models: "
                f"{', '.join(BUILTIN_MODELS)}{hint}"
            )
        try:
            path = ensure_tiny_model(args.path)
        except (ImportError, OSError) as exc:
            raise UserError(f"cannot build {args.path!r}: {exc}") from None
        print(json.dumps({"name": args.path, "path": str(path)}) if args.json else path)
        return 0
    described = describe_models()
    if args.json:
        print(json.dumps({"models": described}))
        return 0
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "LAYERS", "KV HEADS", "HEAD", "DTYPE", "KV/TOKEN", "VLLM ARGS", "PATH"):
        table.add_column(column, justify="right" if column in ("LAYERS", "KV HEADS", "HEAD",
                                                               "KV/TOKEN") else "left")  # fmt: skip
    for m in described:
        table.add_row(
            m["name"], str(m["layers"]), str(m["kv_heads"]), str(m["head_size"]), m["dtype"],
            format_bytes(m["kv_bytes_per_token"]), " ".join(m["vllm_args"]),
            m["path"] + ("" if m["built"] else " (built on first use)"),
        )  # fmt: skip
    console = output_console()
    print_table(console, table)
    console.print(
        "serve one by name (`elastickv serve --model tiny-llama --budget 64M`); give vLLM its "
        'directory: `--model "$(elastickv models --path tiny-llama)" --dtype float32`',
        highlight=False,
        soft_wrap=True,
    )
    return 0


def describe_models() -> list[dict[str, Any]]:
    """Every built-in model as ``models --json`` prints it."""
    from elastickv.models import BUILTIN_MODELS, tiny_model_path

    described = []
    for name, spec in BUILTIN_MODELS.items():
        path = tiny_model_path(spec)
        described.append(
            {
                "name": name,
                "layers": spec.num_hidden_layers,
                "kv_heads": spec.num_key_value_heads,
                "head_size": spec.head_dim,
                "hidden_size": spec.hidden_size,
                "dtype": spec.dtype,
                "parameters": spec.num_parameters,
                "kv_bytes_per_token": spec.kv_bytes_per_token,
                "vllm_args": list(spec.vllm_args),
                "path": str(path),
                "built": path.is_dir(),
            }
        )
    return described
