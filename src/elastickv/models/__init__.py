"""Tiny local test models that real vLLM can load offline."""

from elastickv.models.tiny import (
    BUILTIN_MODELS,
    CACHE_ENV_VAR,
    CPU_ATTENTION_HEAD_SIZES,
    MODEL_FILES,
    SUPPORTED_DTYPES,
    TINY_LLAMA,
    TINY_LLAMA_BF16,
    TINY_LLAMA_DEEP,
    TinyModelSpec,
    build_tiny_model,
    builtin_name_of,
    default_cache_dir,
    ensure_tiny_model,
    get_builtin_model,
    tiny_model_path,
    tiny_model_tensor_shapes,
)

__all__ = [
    "BUILTIN_MODELS",
    "CACHE_ENV_VAR",
    "CPU_ATTENTION_HEAD_SIZES",
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
