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
