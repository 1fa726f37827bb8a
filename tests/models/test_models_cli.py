"""``elastickv models``: what a user needs to run a built-in model without writing Python —
its shape, the vLLM arguments that keep its dtype, and its directory (``--path`` builds it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from elastickv.models import BUILTIN_MODELS, MODEL_FILES, tiny_model_path


def models(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastickv.cli.main", "models", *args],
        env={**os.environ, "ELASTICKV_MODEL_CACHE": str(cache)},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_models_lists_every_builtin_with_its_shape_and_path(tmp_path: Path) -> None:
    listing = models("--json", cache=tmp_path)
    assert listing.returncode == 0, listing.stderr
    described = {m["name"]: m for m in json.loads(listing.stdout)["models"]}
    assert set(described) == set(BUILTIN_MODELS)
    for name, spec in BUILTIN_MODELS.items():
        m = described[name]
        shape = (m["layers"], m["kv_heads"], m["head_size"], m["dtype"])
        assert shape == (spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim,
                         spec.dtype)  # fmt: skip
        assert m["vllm_args"] == ["--dtype", spec.dtype]
        assert m["path"] == str(tiny_model_path(name, tmp_path)) and not m["built"]
    assert described["tiny-llama"]["kv_bytes_per_token"] == 1024  # 2 x 2 layers x 2 x 32 x 4
    text = models(cache=tmp_path).stdout
    assert "tiny-llama-bf16" in text and "--dtype bfloat16" in text and "built on first use" in text


def test_path_builds_the_model_and_prints_only_its_directory(tmp_path: Path) -> None:
    built = models("--path", "tiny-llama", cache=tmp_path)
    assert built.returncode == 0, built.stderr
    path = Path(built.stdout.strip())
    assert built.stdout == f"{path}\n" and path == tiny_model_path("tiny-llama", tmp_path)
    assert {f.name for f in path.iterdir()} >= set(MODEL_FILES)
    again = models("--path", "tiny-llama", cache=tmp_path)  # built once
    assert again.stdout == built.stdout
    typo = models("--path", "tiny-llma", cache=tmp_path)
    assert typo.returncode == 2
    assert (
        "no built-in model 'tiny-llma'" in typo.stderr
        and "did you mean 'tiny-llama'?" in typo.stderr
    )
