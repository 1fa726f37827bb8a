"""Attention shapes of well-known models: the inputs the geometry needs, nothing more."""

from __future__ import annotations

from dataclasses import dataclass

from elastickv.geometry import AttentionKind, KVCacheGeometry


@dataclass(frozen=True)
class ModelShape:
    """The KV-cache-relevant part of a model config (per tensor-parallel rank)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    kind: AttentionKind = AttentionKind.PACKED
    block_size: int = 16

    def geometry(self, num_blocks: int, **overrides: object) -> KVCacheGeometry:
        """A geometry for this model; ``overrides`` set any other geometry field."""
        fields: dict[str, object] = {
            "num_layers": self.num_layers,
            "num_blocks": num_blocks,
            "num_kv_heads": self.num_kv_heads,
            "block_size": self.block_size,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "kind": self.kind,
        }
        fields.update(overrides)
        return KVCacheGeometry(**fields)  # type: ignore[arg-type]


LLAMA3_8B = ModelShape("llama-3-8b", num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16")
QWEN25_05B = ModelShape(
    "qwen2.5-0.5b", num_layers=24, num_kv_heads=2, head_size=64, dtype="bfloat16"
)
DEEPSEEK_V2_LITE = ModelShape(
    "deepseek-v2-lite",
    num_layers=27,
    num_kv_heads=1,
    head_size=576,
    dtype="bfloat16",
    kind=AttentionKind.MLA,
    block_size=64,
)


def tiny_shapes() -> list[ModelShape]:
    """The locally built test models, read from their builder specs."""
    from elastickv.models.tiny import BUILTIN_MODELS

    return [
        ModelShape(
            name,
            num_layers=spec.num_hidden_layers,
            num_kv_heads=spec.num_key_value_heads,
            head_size=spec.head_dim,
            dtype=spec.dtype,
        )
        for name, spec in BUILTIN_MODELS.items()
    ]


def example_shapes() -> dict[str, ModelShape]:
    """Every built-in shape by name (``--model`` choices)."""
    shapes = [LLAMA3_8B, QWEN25_05B, DEEPSEEK_V2_LITE, *tiny_shapes()]
    return {s.name: s for s in shapes}
