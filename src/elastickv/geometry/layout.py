"""Physical KV-cache layouts: the order of the logical axes ``[L, B, H, N, C]`` in memory.

L layers, B blocks, H head slots, N tokens per block, C content bytes per (head, token)
row. A layout names the physical order, outermost first; C is always innermost. The six
members are vLLM 0.32's ``KVCacheLayout``; vLLM 0.28's per-backend stride orders map onto
the same six (see :func:`layout_from_stride_order`).
"""

from __future__ import annotations

import enum

from elastickv.geometry.errors import GeometryError

AXIS_L, AXIS_B, AXIS_H, AXIS_N, AXIS_C = 0, 1, 2, 3, 4
AXIS_NAMES = "LBHNC"


class KVLayout(enum.Enum):
    """A physical order of ``[L, B, H, N, C]``; the value is the stride permutation."""

    LBHNC = (0, 1, 2, 3, 4)  # per layer, HND
    LBNHC = (0, 1, 3, 2, 4)  # per layer, NHD
    LHBNC = (0, 2, 1, 3, 4)  # per layer, head planes outside blocks
    BLHNC = (1, 0, 2, 3, 4)  # block outermost, then layer, HND inside
    BLNHC = (1, 0, 3, 2, 4)  # block outermost, then layer, NHD inside
    BHLNC = (1, 2, 0, 3, 4)  # block outermost, then head, then layer

    @property
    def order(self) -> tuple[int, ...]:
        """Logical axis indices, outermost physical axis first."""
        return self.value

    @property
    def is_layer_outermost(self) -> bool:
        """Each layer owns one contiguous region of the backing (per-layer storage)."""
        return self.value[0] == AXIS_L

    @property
    def is_block_outermost(self) -> bool:
        """Each block owns one contiguous region holding every layer (cross-layer storage)."""
        return self.value[0] == AXIS_B

    @property
    def is_page_compact(self) -> bool:
        """L and B are the two outermost axes: one (layer, block) page is one byte run."""
        return set(self.value[:2]) == {AXIS_L, AXIS_B}

    @property
    def heads_outside_tokens(self) -> bool:
        """HND inside a page (a head's tokens are adjacent) rather than NHD."""
        return self.value.index(AXIS_H) < self.value.index(AXIS_N)

    @classmethod
    def parse(cls, name: str | KVLayout) -> KVLayout:
        """Accept a layout name or the per-layer aliases ``NHD`` and ``HND``."""
        if isinstance(name, KVLayout):
            return name
        key = name.strip().upper()
        if key in _ALIASES:
            return _ALIASES[key]
        try:
            return cls[key]
        except KeyError:
            raise GeometryError(
                "layout", f"unknown layout {name!r}", accepted=LAYOUT_NAMES
            ) from None


_ALIASES = {"NHD": KVLayout.LBNHC, "HND": KVLayout.LBHNC}
LAYOUT_NAMES: tuple[str, ...] = (*(m.name for m in KVLayout), *_ALIASES)


def layout_from_stride_order(stride_order: tuple[int, ...]) -> KVLayout:
    """Map a vLLM 0.28 stride order of the packed shape to a named layout.

    ``stride_order`` is what ``get_kv_cache_stride_order()`` returns for the logical shape
    ``(B, H, N, C)`` (4 entries) or, with ``include_num_layers_dimension=True``,
    ``(L, B, H, N, C)`` (5 entries). The physical order is the logical axes taken in that
    order.
    """
    order = tuple(int(i) for i in stride_order)
    if len(order) == 4:
        if sorted(order) != [0, 1, 2, 3]:
            raise GeometryError("stride_order", f"{order} is not a permutation of 0..3")
        order = (AXIS_L, *(i + 1 for i in order))
    elif len(order) != 5 or sorted(order) != [0, 1, 2, 3, 4]:
        raise GeometryError(
            "stride_order", f"{order} is not a permutation of 0..3 (per layer) or 0..4"
        )
    for layout in KVLayout:
        if layout.value == order:
            return layout
    raise GeometryError(
        "stride_order",
        f"{stride_order} gives physical order "
        f"{''.join(AXIS_NAMES[i] for i in order)}, which no supported layout has",
        accepted=[m.name for m in KVLayout],
    )


def vllm028_layout(kv_layout: str, cross_layer: bool) -> KVLayout:
    """The layout vLLM 0.28 builds for a packed backend under ``NHD``/``HND``.

    Per-layer storage keeps the backend order; cross-layer storage prepends the layer axis
    exactly as the backends' ``include_num_layers_dimension=True`` stride orders do. This is
    what the backends whose stride order follows ``VLLM_KV_CACHE_LAYOUT`` build (FlashAttention,
    Triton, FlashInfer); backends without a stride order (CPU, ROCm AITER) are identity
    (``LBHNC`` either way) and FlexAttention is always ``NHD``.
    """
    key = kv_layout.strip().upper()
    table = {
        ("NHD", False): (0, 2, 1, 3),
        ("HND", False): (0, 1, 2, 3),
        ("NHD", True): (1, 0, 3, 2, 4),
        ("HND", True): (1, 2, 0, 3, 4),
    }
    if (key, cross_layer) not in table:
        raise GeometryError("layout", f"{kv_layout!r} under the 0.28 contract", ["NHD", "HND"])
    return layout_from_stride_order(table[(key, cross_layer)])
