"""Byte-level helpers shared by the real-vLLM contract tests (no vLLM import here)."""

from __future__ import annotations

import torch

from elastickv.geometry import ByteRange, merge_ranges

_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_MAX_VALUE = {1: 255, 2: (1 << 15) - 1, 4: (1 << 31) - 1}


def as_int(view: torch.Tensor) -> torch.Tensor:
    """The same elements reinterpreted bit for bit as an integer dtype of equal width."""
    return view.view(_INT_DTYPES[view.element_size()])


def pattern(view: torch.Tensor, salt: int) -> torch.Tensor:
    """Nonzero integers, one per element of ``view`` (logical order), distinct per ``salt``.

    The value is a mix of the element's logical index (layer/side via ``salt``, then block,
    head or token, ... in the view's own axis order), so a misplaced byte shows up.
    """
    esize = view.element_size()
    ids = torch.arange(view.numel(), dtype=torch.int64).reshape(view.shape)
    mixed = (ids + salt * 1_000_003) * 2_654_435_761 + salt * 40_503
    values = mixed % _MAX_VALUE[esize] + 1
    return values.to(_INT_DTYPES[esize])


def write_pattern(view: torch.Tensor, salt: int) -> torch.Tensor:
    """Write :func:`pattern` through ``view`` (zero copy); return what was written."""
    values = pattern(view, salt)
    as_int(view).copy_(values)
    return values


def raw_backing(view: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``view`` as one flat int8 tensor (zero copy)."""
    return torch.empty(0, dtype=torch.int8).set_(view.untyped_storage())


def touched_runs(backing: torch.Tensor) -> list[ByteRange]:
    """Merged ``[start, end)`` runs of the nonzero bytes of a flat backing."""
    index = torch.nonzero(backing).flatten()
    if index.numel() == 0:
        return []
    breaks = torch.nonzero(index[1:] != index[:-1] + 1).flatten()
    starts = [int(index[0]), *(int(index[i + 1]) for i in breaks)]
    ends = [*(int(index[i]) + 1 for i in breaks), int(index[-1]) + 1]
    return merge_ranges(list(zip(starts, ends, strict=True)))


def mark(view: torch.Tensor) -> None:
    """Set every byte ``view`` covers to 1 (its last dimension must be dense)."""
    view.view(torch.uint8).fill_(1)


def packed_side_pairs(
    ours: tuple[torch.Tensor, torch.Tensor],
    our_scales: tuple[torch.Tensor, torch.Tensor] | None,
    theirs: torch.Tensor,
    head_size: int,
    head_size_v: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair our K/V (and scale) views with vLLM's own reading of one packed layer view.

    vLLM reads packed rows as ``theirs.transpose(1, 2).split(head_size, -1)``; per-token-head
    rows (``our_scales`` given) as halves of ``[data | fp32 scale]``, with the scales from
    Triton's own ``_ensure_scale_caches``.
    """
    import types

    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    our_k, our_v = ours
    rows = theirs.transpose(1, 2)
    if our_scales is not None:
        padded = theirs.shape[-1] // 2
        data = padded - 4 // theirs.element_size()
        their_k, their_v = (half[..., :data] for half in torch.split(rows, padded, dim=-1))
        stub = types.SimpleNamespace(_k_scale_cache=None, _v_scale_cache=None)
        TritonAttentionImpl._ensure_scale_caches(stub, theirs)
        return [
            (our_k, their_k),
            (our_v, their_v),
            (our_scales[0], stub._k_scale_cache.transpose(1, 2)),
            (our_scales[1], stub._v_scale_cache.transpose(1, 2)),
        ]
    chunks = torch.split(rows, head_size, dim=-1)
    if len(chunks) != 2:  # head_size_v > head_size: split(head_size) cuts V again
        chunks = torch.split(rows, [head_size, head_size_v], dim=-1)
    return [(our_k, chunks[0]), (our_v, chunks[1])]
