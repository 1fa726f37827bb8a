"""The tiny-model builder: complete, deterministic, validated and cached."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import elastickv.models.tiny as tiny
from elastickv.models import (
    BUILTIN_MODELS,
    CACHE_ENV_VAR,
    MODEL_FILES,
    TINY_LLAMA,
    TINY_LLAMA_BF16,
    TinyModelSpec,
    build_tiny_model,
    default_cache_dir,
    ensure_tiny_model,
    get_builtin_model,
    tiny_model_tensor_shapes,
)

safetensors_torch = pytest.importorskip("safetensors.torch")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("numpy")

SRC_DIR = Path(tiny.__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("built")
    return {name: build_tiny_model(spec, root / name) for name, spec in BUILTIN_MODELS.items()}


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _file_bytes(model_dir: Path) -> dict[str, bytes]:
    return {name: (model_dir / name).read_bytes() for name in MODEL_FILES}


def test_builtin_specs_differ_in_shape_and_dtype() -> None:
    assert set(BUILTIN_MODELS) == {TINY_LLAMA.name, TINY_LLAMA_BF16.name, "tiny-llama-deep"}
    assert TINY_LLAMA.dtype == "float32"
    assert TINY_LLAMA_BF16.dtype == "bfloat16"
    for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(TINY_LLAMA, field) != getattr(TINY_LLAMA_BF16, field), field
    assert get_builtin_model("tiny-llama") is TINY_LLAMA
    with pytest.raises(ValueError, match="tiny-llama-bf16"):
        get_builtin_model("no-such-model")


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_build_writes_a_complete_llama_directory(built: dict[str, Path], name: str) -> None:
    spec = BUILTIN_MODELS[name]
    model_dir = built[name]
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(MODEL_FILES)

    config = _read_json(model_dir / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        assert config[field] == getattr(spec, field), field
    assert config["torch_dtype"] == spec.dtype

    tensors = safetensors_torch.load_file(str(model_dir / "model.safetensors"))
    expected = tiny_model_tensor_shapes(spec)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert "model.layers.0.self_attn.q_proj.weight" in expected
    assert f"model.layers.{spec.num_hidden_layers - 1}.mlp.down_proj.weight" in expected
    assert spec.num_parameters == sum(v.numel() for v in tensors.values())
    for key, value in tensors.items():
        assert str(value.dtype) == f"torch.{spec.dtype}", key
        if key.endswith("norm.weight"):
            assert bool((value == 1).all()), key
        else:
            std = float(value.float().std())
            assert 0.5 * spec.init_std < std < 1.5 * spec.init_std, key


def test_tokenizer_round_trips_and_matches_the_model(built: dict[str, Path]) -> None:
    model_dir = built[TINY_LLAMA.name]
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == TINY_LLAMA.vocab_size

    config = _read_json(model_dir / "config.json")
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    special_map = _read_json(model_dir / "special_tokens_map.json")
    generation = _read_json(model_dir / "generation_config.json")
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "{{ bos_token }}" in tok_config["chat_template"]
    for role in ("bos", "eos", "pad"):
        token = tok_config[f"{role}_token"]
        assert special_map[f"{role}_token"] == token
        assert tokenizer.token_to_id(token) == config[f"{role}_token_id"]
        assert generation[f"{role}_token_id"] == config[f"{role}_token_id"]

    for text in ("Hello, my name is Ada.", "你好，世界！", "12 + 34 = 46"):
        encoding = tokenizer.encode(text)
        assert encoding.ids[0] == config["bos_token_id"]
        assert len(encoding.ids) < len(text.encode()) + 1
        assert tokenizer.decode(encoding.ids) == text


def test_small_corpus_is_topped_up_to_the_vocab_size(tmp_path: Path) -> None:
    spec = dataclasses.replace(TINY_LLAMA, name="wide-vocab", vocab_size=4096)
    model_dir = build_tiny_model(spec, tmp_path / spec.name)
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == spec.vocab_size
    assert tokenizer.id_to_token(spec.vocab_size - 1).startswith("<|reserved_")


def test_same_spec_gives_byte_identical_files(built: dict[str, Path], tmp_path: Path) -> None:
    again = build_tiny_model(TINY_LLAMA, tmp_path / "again")
    assert _file_bytes(again) == _file_bytes(built[TINY_LLAMA.name])


def test_build_is_identical_in_another_process(built: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "other-process"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
    env["PYTHONHASHSEED"] = "12345"
    code = (
        "import sys\n"
        "from elastickv.models import TINY_LLAMA, build_tiny_model\n"
        "build_tiny_model(TINY_LLAMA, sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, timeout=300)
    assert _file_bytes(out) == _file_bytes(built[TINY_LLAMA.name])


def test_different_seed_changes_only_the_weights(built: dict[str, Path], tmp_path: Path) -> None:
    reseeded = dataclasses.replace(TINY_LLAMA, seed=TINY_LLAMA.seed + 1)
    assert reseeded.digest() != TINY_LLAMA.digest()
    other = build_tiny_model(reseeded, tmp_path / "reseeded")
    ours = _file_bytes(built[TINY_LLAMA.name])
    theirs = _file_bytes(other)
    assert theirs["model.safetensors"] != ours["model.safetensors"]
    assert theirs["tokenizer.json"] == ours["tokenizer.json"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"name": ""}, "name"),
        ({"name": "../escape"}, "name"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"vocab_size": 512.0}, "vocab_size"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"intermediate_size": -1}, "intermediate_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_attention_heads": True}, "num_attention_heads"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 16}, "head_dim"),
        ({"head_dim": 48}, "head_dim"),
        ({"dtype": "fp16"}, "dtype"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"seed": -1}, "seed"),
        ({"init_std": 0.0}, "init_std"),
        ({"init_std": float("nan")}, "init_std"),
    ],
)
def test_invalid_spec_names_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(TINY_LLAMA, **changes)


def test_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY_LLAMA.seed = 3  # type: ignore[misc]


def test_ensure_builds_once_and_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    first = ensure_tiny_model(TINY_LLAMA, cache)
    assert first == cache / f"{TINY_LLAMA.name}-{TINY_LLAMA.digest()}"
    assert sorted(p.name for p in first.iterdir()) == sorted(MODEL_FILES)
    assert [p.name for p in cache.iterdir()] == [first.name]

    def fail(*args: object, **kwargs: object) -> Path:
        raise AssertionError("a cached model was rebuilt")

    monkeypatch.setattr(tiny, "build_tiny_model", fail)
    assert ensure_tiny_model(TINY_LLAMA, cache) == first
    assert ensure_tiny_model(TINY_LLAMA.name, cache) == first


def test_concurrent_ensure_calls_agree(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: ensure_tiny_model(TINY_LLAMA, cache), range(3)))
    assert len(set(paths)) == 1
    assert [p.name for p in cache.iterdir()] == [paths[0].name]
    assert sorted(p.name for p in paths[0].iterdir()) == sorted(MODEL_FILES)


def test_ensure_leaves_no_partial_entry_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"

    def broken(spec: TinyModelSpec, out_dir: Path) -> Path:
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "build_tiny_model", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_tiny_model(TINY_LLAMA, cache)
    assert list(cache.iterdir()) == []


def test_ensure_uses_the_environment_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "env-cache"))
    assert default_cache_dir() == tmp_path / "env-cache"
    path = ensure_tiny_model(TINY_LLAMA)
    assert path.parent == tmp_path / "env-cache"
    monkeypatch.delenv(CACHE_ENV_VAR)
    assert default_cache_dir() == Path.home() / ".cache" / "elastickv" / "models"


@pytest.mark.parametrize("module", ["tokenizers", "safetensors"])
def test_missing_extra_explains_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"pip install 'elastickv\[models\]'") as info:
        build_tiny_model(TINY_LLAMA, tmp_path / "never")
    assert module in str(info.value)
    assert not (tmp_path / "never").exists()
