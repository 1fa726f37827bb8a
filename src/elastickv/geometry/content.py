"""What one (head slot, token) row holds: element dtype, quantization, K/V content bytes.

Names and byte formats follow vLLM's ``kv_cache_dtype`` strings:

* ``auto`` — the model dtype; a row is ``[K (Dk) | V (Dv)]``.
* ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` — per-tensor fp8 stored as uint8; scales live
  outside the pages.
* ``int8_per_token_head`` / ``fp8_per_token_head`` / ``int4_per_token_head`` — each side
  carries its own fp32 scale: ``[K data | fp32 | V data | fp32]``; int4 stores D/2 bytes.
* ``nvfp4`` — K and V are separate head slots (heads ``[0, H)`` are K, ``[H, 2H)`` V), each
  row ``D/2`` fp4 bytes then ``D/16`` fp8 scale bytes, and each side of a block is stored
  as all its data, then all its scales.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from elastickv.geometry.errors import GeometryError

MODEL_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
}

SCALE_BYTES = 4  # one fp32 scale per (token, head, side) in per-token-head modes


class KVQuant(enum.Enum):
    """How K/V values are stored in a row."""

    NONE = "auto"
    FP8 = "fp8"
    INT8_PER_TOKEN_HEAD = "int8_per_token_head"
    FP8_PER_TOKEN_HEAD = "fp8_per_token_head"
    INT4_PER_TOKEN_HEAD = "int4_per_token_head"
    NVFP4 = "nvfp4"

    @property
    def is_per_token_head(self) -> bool:
        return self in _PER_TOKEN_HEAD

    @classmethod
    def parse(cls, kv_cache_dtype: str | KVQuant) -> KVQuant:
        if isinstance(kv_cache_dtype, KVQuant):
            return kv_cache_dtype
        key = kv_cache_dtype.strip().lower()
        if key in _FP8_NAMES:
            return cls.FP8
        for member in cls:
            if member.value == key:
                return member
        raise GeometryError(
            "kv_cache_dtype", f"unknown KV cache dtype {kv_cache_dtype!r}", KV_CACHE_DTYPES
        )


_PER_TOKEN_HEAD = {
    KVQuant.INT8_PER_TOKEN_HEAD,
    KVQuant.FP8_PER_TOKEN_HEAD,
    KVQuant.INT4_PER_TOKEN_HEAD,
}
_FP8_NAMES = {"fp8", "fp8_e4m3", "fp8_e5m2"}
KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto",
    *sorted(_FP8_NAMES),
    *(q.value for q in list(KVQuant)[2:]),
)


@dataclass(frozen=True)
class RowFormat:
    """The byte format of one (head slot, token) row, and of K and V inside it.

    ``k_offset``/``v_offset`` and ``k_bytes``/``v_bytes`` locate each side's data inside
    the row; ``k_scale_offset``/``v_scale_offset`` locate the fp32 scale of per-token-head
    modes (``None`` otherwise). ``side_bytes`` is the width that ``split(side, -1)`` cuts
    a packed row at.
    """

    storage_dtype: torch.dtype
    content_bytes: int
    k_offset: int
    k_bytes: int
    v_offset: int
    v_bytes: int
    side_bytes: int
    k_scale_offset: int | None = None
    v_scale_offset: int | None = None

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()


def model_dtype(name: str) -> torch.dtype:
    try:
        return MODEL_DTYPES[name.strip().lower()]
    except KeyError:
        raise GeometryError("dtype", f"unsupported model dtype {name!r}", MODEL_DTYPES) from None


def storage_dtype(quant: KVQuant, dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the engine-facing view (what vLLM's tensors are typed as)."""
    if quant is KVQuant.NONE:
        return dtype
    if quant is KVQuant.INT8_PER_TOKEN_HEAD:
        return torch.int8
    return torch.uint8


def nvfp4_row_bytes(head_size: int) -> int:
    """fp4 data (two values a byte) plus one fp8 scale per 16 values."""
    return head_size // 2 + head_size // 16
