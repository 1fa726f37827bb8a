"""``elastickv layout explain`` and ``elastickv layout tour`` through the real console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastickv.geometry import KVCacheGeometry, layer_views

SCRIPT = Path(sys.executable).with_name("elastickv")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False
    )


def explain_json(*args: str) -> dict[str, Any]:
    result = run_cli("layout", "explain", "--json", *args)
    assert result.returncode == 0, result.stderr
    payload: dict[str, Any] = json.loads(result.stdout)
    return payload


def test_json_is_the_documented_interface() -> None:
    out = explain_json(
        "--layers",
        "3",
        "--kv-heads",
        "2",
        "--head-size",
        "32",
        "--dtype",
        "float32",
        "--num-blocks",
        "10",
        "--layout",
        "NHD",
    )
    geometry = KVCacheGeometry(
        num_layers=3,
        num_blocks=10,
        num_kv_heads=2,
        block_size=16,
        head_size=32,
        dtype="float32",
        layout="NHD",
    )
    expected = [v.as_dict() for v in layer_views(geometry)]
    assert out["layers"] == expected
    assert out["backing_bytes"] == geometry.backing_bytes
    assert out["block_bytes_per_layer"] == 2 * 16 * 64 * 4
    assert out["layout"] == "LBNHC"
    assert out["blocks_per_page"] == (2 << 20) / geometry.block_stride_bytes
    assert out["warnings"] == []


def test_cross_layer_028_warns_for_a_large_model() -> None:
    out = explain_json("--model", "llama-3-8b", "--contract", "0.28", "--cross-layer")
    assert out["layout"] == "BHLNC"
    assert out["pages_per_block"] == 1
    assert any("-31%" in w for w in out["warnings"])
    text = run_cli("layout", "explain", "--model", "llama-3-8b", "--layout", "BLNHC")
    assert text.returncode == 0
    assert "warning" in text.stdout and "every attention read" in " ".join(text.stdout.split())


def test_model_preset_and_overrides() -> None:
    out = explain_json("--model", "tiny-llama", "--kernel-block-size", "8", "--num-blocks", "4")
    assert out["layers"][0]["shape"] == [8, 2, 8, 64]
    assert out["kernel_block_size"] == 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "2", "--kv-heads", "2"], "--head-size is required"),
        (["--model", "tiny-llama", "--layout", "XYZ"], "unknown layout 'XYZ'"),
        (["--model", "tiny-llama", "--kernel-block-size", "5"], "does not divide block_size"),
        (["--model", "tiny-llama", "--cross-layer"], "0.28-contract flag"),
        (["--model", "tiny-llama", "--kv-cache-dtype", "nvfp4", "--layout", "NHD"], "nvfp4"),
        (["--model", "tiny-llama", "--page-size", "2Q"], "invalid size"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], message: str) -> None:
    result = run_cli("layout", "explain", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_tour_runs_every_layout_for_real(tmp_path: Path) -> None:
    result = run_cli("layout", "tour", "--json", "--model-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    models = {r["model"] for r in rows}
    assert {"llama-3-8b", "tiny-llama", "tiny-llama-bf16"} <= models
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    cases = {r["case"] for r in rows if r["model"] == "llama-3-8b"}
    assert {
        f"0.32 {name}" for name in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
    } <= cases
    assert (tmp_path.glob("tiny-llama-*/config.json")).__next__().is_file()


TRANSFER_SHAPE = ("--layers", "2", "--kv-heads", "2", "--head-size", "8", "--num-blocks", "6")


def test_transfer_json_is_the_plan_of_the_core() -> None:
    from elastickv.geometry import RemoteSide, plan_transfer

    out = explain_json(*TRANSFER_SHAPE, "--transfer", "--remote-tp", "2", "--block", "4")
    geometry = KVCacheGeometry(
        num_layers=2, num_blocks=6, num_kv_heads=2, block_size=16, head_size=8, layout="HND"
    )
    plan = plan_transfer(geometry, RemoteSide(2))
    assert out["transfer"] == {**plan.as_dict(4), "ranks": [[s.as_dict() for s in plan.slices]]}
    # Local TP 1 reads one head from each of the two remote ranks, per layer.
    assert [(t["remote_rank"], t["local"]["heads"]) for t in out["transfer"]["transfers"]] == [
        (0, [0, 1]),
        (0, [0, 1]),
        (1, [1, 2]),
        (1, [1, 2]),
    ]
    assert out["transfer"]["bytes_per_block"] == 2 * geometry.page_bytes
    assert "transfer" not in explain_json(*TRANSFER_SHAPE)


def test_transfer_table_and_refusal() -> None:
    shown = run_cli("layout", "explain", *TRANSFER_SHAPE, "--transfer", "--tp", "2")
    assert shown.returncode == 0, shown.stderr
    assert "Head slices per local rank" in shown.stdout
    assert "4 regions" not in shown.stdout and "2 regions, " in shown.stdout
    refused = run_cli(
        "layout",
        "explain",
        *TRANSFER_SHAPE,
        "--head-size",
        "32",
        "--kv-cache-dtype",
        "nvfp4",
        "--transfer",
        "--remote-tp",
        "2",
    )
    assert refused.returncode == 2
    assert "same TP size" in refused.stderr and "nvfp4" in refused.stderr
