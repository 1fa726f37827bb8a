"""Tiny Llama checkpoints built locally, so tests can run real vLLM without downloading a model.

A build writes a complete Hugging Face model directory (config, safetensors weights, a byte-level
BPE tokenizer trained on a small built-in corpus, generation config). The same spec always gives
byte-identical files, so greedy outputs can be compared across processes and machines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "CACHE_ENV_VAR",
    "CPU_ATTENTION_HEAD_SIZES",
    "LLAMA_100M",
    "MODEL_FILES",
    "SUPPORTED_DTYPES",
    "TINY_LLAMA",
    "TINY_LLAMA_BF16",
    "TINY_LLAMA_DEEP",
    "TinyModelSpec",
    "build_tiny_model",
    "builtin_name_of",
    "default_cache_dir",
    "ensure_tiny_model",
    "get_builtin_model",
    "tiny_model_path",
    "tiny_model_tensor_shapes",
]

CACHE_ENV_VAR: Final = "ELASTICKV_MODEL_CACHE"
"""Environment variable that overrides where `ensure_tiny_model` caches built models."""

SUPPORTED_DTYPES: Final = ("float32", "bfloat16", "float16")

CPU_ATTENTION_HEAD_SIZES: Final = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention backend accepts (0.28 and 0.32 list the same ones)."""

MODEL_FILES: Final = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Bumped whenever the builder's output changes, so stale cache entries are never reused.
_BUILD_FORMAT_VERSION: Final = 1

_PAD, _BOS, _EOS = "<pad>", "<s>", "</s>"
_ROLE_TOKENS: Final = ("<|system|>", "<|user|>", "<|assistant|>")
_SPECIAL_TOKENS: Final = (_PAD, _BOS, _EOS, *_ROLE_TOKENS)
_BYTE_ALPHABET_SIZE: Final = 256
_MIN_VOCAB_SIZE: Final = _BYTE_ALPHABET_SIZE + len(_SPECIAL_TOKENS)
_MAX_VOCAB_SIZE: Final = 65536

_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

# safetensors' torch writer goes through numpy, hence the third module.
_EXTRA_MODULES: Final = ("safetensors", "tokenizers", "numpy")
_MISSING_EXTRA: Final = (
    "building tiny models needs the optional dependencies of elastickv[models] "
    "(safetensors[torch], tokenizers); missing: {missing}. "
    "Install them with: pip install 'elastickv[models]'"
)


def _require_model_extras() -> None:
    """Fail before writing anything when an optional dependency is absent."""
    missing = []
    for module in _EXTRA_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    if missing:
        raise ImportError(_MISSING_EXTRA.format(missing=", ".join(missing)))


def _check_int(field: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{field} must be <= {maximum}, got {value}")


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Shape, dtype and seed of a tiny Llama; everything a build depends on.

    The defaults are the smallest model vLLM's CPU backend runs. `init_std` is larger than a real
    initialiser's so that greedy decoding of random weights gives varied tokens, not one repeated.
    """

    name: str
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    max_position_embeddings: int = 2048
    seed: int = 0
    init_std: float = 0.08

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"name must be a non-empty directory-safe name (letters, digits, '.', '_', '-', "
                f"not starting with '.', '_' or '-'), got {self.name!r}"
            )
        _check_int("vocab_size", self.vocab_size, _MIN_VOCAB_SIZE, _MAX_VOCAB_SIZE)
        _check_int("hidden_size", self.hidden_size, 1)
        _check_int("intermediate_size", self.intermediate_size, 1)
        _check_int("num_hidden_layers", self.num_hidden_layers, 1)
        _check_int("num_attention_heads", self.num_attention_heads, 1)
        _check_int("num_key_value_heads", self.num_key_value_heads, 1)
        _check_int("head_dim", self.head_dim, CPU_ATTENTION_HEAD_SIZES[0])
        if self.head_dim not in CPU_ATTENTION_HEAD_SIZES:
            raise ValueError(
                f"head_dim must be one of {CPU_ATTENTION_HEAD_SIZES} (the sizes vLLM's CPU "
                f"attention backend accepts), got {self.head_dim}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        _check_int("max_position_embeddings", self.max_position_embeddings, 1)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        if (
            isinstance(self.init_std, bool)
            or not isinstance(self.init_std, int | float)
            or not math.isfinite(self.init_std)
            or self.init_std <= 0
        ):
            raise ValueError(f"init_std must be a finite number > 0, got {self.init_std!r}")

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain JSON-ready values."""
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A short stable hash of the spec and builder version; names the cache entry."""
        payload = {"format": _BUILD_FORMAT_VERSION, "spec": self.to_dict()}
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes in vLLM (K and V of every layer, in ``dtype``)."""
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize

    @property
    def vllm_args(self) -> tuple[str, ...]:
        """The vLLM arguments that serve this model in its own dtype. vLLM's default,
        ``--dtype auto``, runs a float32 checkpoint in bfloat16 on a CPU (its log says
        "Downcasting torch.float32 to torch.bfloat16")."""
        return ("--dtype", self.dtype)

    @property
    def num_parameters(self) -> int:
        """Total parameter count, to size memory before building."""
        return sum(math.prod(shape) for shape in tiny_model_tensor_shapes(self).values())


TINY_LLAMA: Final = TinyModelSpec(name="tiny-llama")
"""2 layers, hidden 128, 4 query / 2 KV heads of size 32, float32 (about 0.4 M parameters)."""

TINY_LLAMA_BF16: Final = TinyModelSpec(
    name="tiny-llama-bf16",
    hidden_size=384,
    intermediate_size=768,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=64,
    dtype="bfloat16",
    seed=1,
)
"""3 layers, hidden 384, 6 query / 3 KV heads of size 64, bfloat16: a second shape to test on."""

TINY_LLAMA_DEEP: Final = TinyModelSpec(
    name="tiny-llama-deep",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    dtype="float32",
    seed=2,
)
"""4 layers, hidden 256, 8 query / 4 KV heads of size 32, float32: the KV-hungriest built-in
(4 KiB per token), the third shape of the multi-model benchmark."""

LLAMA_100M: Final = TinyModelSpec(
    name="llama-100m",
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    dtype="float32",
    seed=3,
)
"""8 layers, hidden 1024, 16 query / 4 KV heads of size 64, float32: about 99 M parameters,
376 MiB of weights, so that releasing and reloading them is measurable against the engine's
own memory (``benchmarks/bench_sleep.py``). Not in :data:`BUILTIN_MODELS`: everything that
builds every built-in model (the model tests, ``layout tour``) would build it too."""

BUILTIN_MODELS: Final[Mapping[str, TinyModelSpec]] = {
    spec.name: spec for spec in (TINY_LLAMA, TINY_LLAMA_BF16, TINY_LLAMA_DEEP)
}


def get_builtin_model(name: str) -> TinyModelSpec:
    """Look up a built-in spec by name, with an error that lists the valid names."""
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ValueError(f"unknown tiny model {name!r}; built-in models: {known}") from None


def tiny_model_tensor_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """Llama checkpoint tensor names and shapes, in the order the weights are drawn."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_dim = spec.num_attention_heads * spec.head_dim
    kv_dim = spec.num_key_value_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, hidden)}
    for i in range(spec.num_hidden_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (spec.vocab_size, hidden)
    return shapes


def default_cache_dir() -> Path:
    """Where built models are kept: `$ELASTICKV_MODEL_CACHE`, else `~/.cache/elastickv/models`."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "elastickv" / "models"


def build_tiny_model(spec: TinyModelSpec, out_dir: str | os.PathLike[str]) -> Path:
    """Write a loadable Llama model directory for `spec` into `out_dir` and return its path.

    Existing files with the same names are overwritten; other files are left alone.
    """
    _require_model_extras()
    tokenizer = _train_tokenizer(spec.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special_ids = {token: _token_id(tokenizer, token) for token in _SPECIAL_TOKENS}

    _write_json(out / "config.json", _model_config(spec, special_ids))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": special_ids[_BOS],
            "eos_token_id": special_ids[_EOS],
            "pad_token_id": special_ids[_PAD],
        },
    )
    _write_weights(spec, out / "model.safetensors")
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": _BOS,
            "eos_token": _EOS,
            "pad_token": _PAD,
            "additional_special_tokens": list(_ROLE_TOKENS),
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.max_position_embeddings,
            "chat_template": _CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": _BOS,
            "eos_token": _EOS,
            "pad_token": _PAD,
            "additional_special_tokens": list(_ROLE_TOKENS),
        },
    )
    # safetensors creates its file owner-only; give it the umask-derived mode the JSON files got.
    (out / "model.safetensors").chmod(_file_mode(out))
    return out


def ensure_tiny_model(
    spec: TinyModelSpec | str, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Return a cached build of `spec`, building it once if needed.

    The build goes into a temporary sibling directory that is renamed into place, so a directory
    under its final name is always complete, even with concurrent callers.
    """
    if isinstance(spec, str):
        spec = get_builtin_model(spec)
    final = tiny_model_path(spec, cache_dir)
    root = final.parent
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        build_tiny_model(spec, tmp)
        # mkdtemp makes the directory owner-only; a shared cache should follow the umask instead.
        mode = _file_mode(tmp)
        tmp.chmod(mode | (mode & 0o444) >> 2)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def tiny_model_path(
    spec: TinyModelSpec | str, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Where :func:`ensure_tiny_model` keeps ``spec``'s build (built or not): the cache
    entry ``<name>-<digest>``, so a changed spec or builder never reuses a stale build."""
    if isinstance(spec, str):
        spec = get_builtin_model(spec)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{spec.name}-{spec.digest()}"


def builtin_name_of(path: str | os.PathLike[str]) -> str | None:
    """The built-in model whose cache entry ``path`` names (``tiny-llama-294ab082d78f`` ->
    ``tiny-llama``), wherever the cache is; None for any other path."""
    entry = os.path.basename(os.fspath(path).rstrip("/"))
    name, _, digest = entry.rpartition("-")
    spec = BUILTIN_MODELS.get(name)
    return name if spec is not None and digest == spec.digest() else None


def _file_mode(model_dir: Path) -> int:
    return (model_dir / "config.json").stat().st_mode & 0o777


def _write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _model_config(spec: TinyModelSpec, special_ids: Mapping[str, int]) -> dict[str, Any]:
    rope_theta = 10000.0
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.init_std,
        "rms_norm_eps": 1e-05,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": special_ids[_BOS],
        "eos_token_id": special_ids[_EOS],
        "pad_token_id": special_ids[_PAD],
        "torch_dtype": spec.dtype,
        "dtype": spec.dtype,
    }


def _write_weights(spec: TinyModelSpec, path: Path) -> None:
    import torch

    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ImportError(_MISSING_EXTRA.format(missing=exc.name)) from exc

    dtype: torch.dtype = getattr(torch, spec.dtype)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in tiny_model_tensor_shapes(spec).items():
        if name.endswith("norm.weight"):
            weight = torch.ones(shape, dtype=torch.float32)
        else:
            weight = torch.randn(shape, generator=generator, dtype=torch.float32) * spec.init_std
        tensors[name] = weight.to(dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if not isinstance(token_id, int):
        raise RuntimeError(f"trained tokenizer lacks the special token {token!r}")
    return token_id


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer with exactly `vocab_size` entries on the built-in corpus."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    except ImportError as exc:
        raise ImportError(_MISSING_EXTRA.format(missing=exc.name)) from exc

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    # A corpus too small for the requested size is topped up with reserved tokens, so token ids
    # and the embedding rows always line up one to one.
    shortfall = vocab_size - tokenizer.get_vocab_size()
    if shortfall > 0:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(shortfall)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer has {tokenizer.get_vocab_size()} entries, expected {vocab_size}"
        )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A",
        pair=f"{_BOS} $A {_BOS} $B",
        special_tokens=[(_BOS, _token_id(tokenizer, _BOS))],
    )
    return tokenizer


_ENGLISH: Final = (
    "The quick brown fox jumps over the lazy dog.",
    "A cache keeps the keys and values of every token that the model has already seen.",
    "Memory is reserved up front, but pages are only mapped when a request needs them.",
    "When the server is idle, the cache shrinks and gives its memory back to the system.",
    "Hello, my name is Ada and I like to write small programs that test big ideas.",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Once upon a time there was a little robot who wanted to learn how to count.",
    "Please answer the question in one short sentence.",
    "What is the weather like today? It is sunny, with a light wind from the west.",
    "Large language models predict the next token from the tokens that came before it.",
    "Each layer has an attention block and a feed-forward block with a residual path.",
    "Scheduling many requests at once keeps the processor busy and the latency low.",
    "If a request cannot be scheduled now, it waits until enough blocks are free.",
    "Tests should be small, fast, repeatable and independent of the network.",
    "The river runs through the valley, past the old mill and under the stone bridge.",
    "She opened the window, and the smell of rain filled the quiet room.",
    "Numbers, letters and punctuation marks all become tokens in the end.",
    "Good morning! How are you? I am fine, thank you, and you?",
    "The user asked for a summary; the assistant replied with three bullet points.",
    "Computers store text as bytes, and a byte-level tokenizer never sees an unknown word.",
)

_CHINESE: Final = (
    "你好，世界！今天天气很好。",
    "我们正在测试一个很小的语言模型。",
    "缓存保存了每个词元的键和值。",
    "当服务器空闲时，内存会被释放回系统。",
    "请用一句话回答这个问题。",
    "北京是中国的首都，上海是一座大城市。",
    "机器学习需要大量的数据和计算资源。",
    "他喜欢在早上喝茶，然后去公园散步。",
    "一二三四五六七八九十，百千万。",
    "谢谢你的帮助，我们明天再见。",
)


def _corpus() -> Iterator[str]:
    """A small fixed corpus: English, Chinese and arithmetic, so all three tokenize compactly."""
    for _ in range(3):
        yield from _ENGLISH
        yield from _CHINESE
    for a in range(0, 100, 3):
        for b in range(1, 40, 7):
            yield f"{a} + {b} = {a + b}"
            yield f"{a} - {b} = {a - b}"
            yield f"{a} * {b} = {a * b}"
    for a in range(1, 13):
        yield " ".join(f"{a}x{b}={a * b}" for b in range(1, 13))
    yield "0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.5 -7 (1 + 2) * 3 = 9"
