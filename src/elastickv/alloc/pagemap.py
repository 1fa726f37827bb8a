"""Which physical pages each block touches, grouped into slabs of blocks that share them.

The geometry says which bytes a block occupies; the allocator needs the pages under them.
Blocks whose page sets are identical form a *slab*: they are committed, filled and drained
together, so placement works on slabs (a few hundred) instead of blocks (tens of thousands).
This covers every layout the geometry supports: per-layer storage (a slab is a run of blocks
and its pages are one page per layer), block-outermost storage (a block may span several
pages, neighbouring slabs may share a boundary page), padded pages and head-plane layouts
(LHBNC, where one block touches a page in every plane).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from elastickv.geometry import KVCacheGeometry


class PageMap:
    """Static block → slab → pages map of one geometry over ``page_size`` pages. Immutable."""

    __slots__ = (
        "block_slab",
        "num_blocks",
        "num_pages",
        "page_size",
        "page_slabs",
        "slab_blocks",
        "slab_pages",
        "typical_slab_blocks",
        "typical_slab_pages",
    )

    block_slab: tuple[int, ...]
    num_blocks: int
    num_pages: int
    page_size: int
    page_slabs: tuple[tuple[int, ...], ...]
    slab_blocks: tuple[tuple[int, ...], ...]
    slab_pages: tuple[tuple[int, ...], ...]
    typical_slab_blocks: int
    typical_slab_pages: int

    def __init__(self, geometry: KVCacheGeometry, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        num_pages = -(-geometry.backing_bytes // page_size)
        slab_of_key: dict[tuple[int, ...], int] = {}
        blocks: list[list[int]] = []
        block_slab: list[int] = []
        for block in range(geometry.num_blocks):
            key = tuple(geometry.block_pages(block, page_size))
            slab = slab_of_key.setdefault(key, len(slab_of_key))
            if slab == len(blocks):
                blocks.append([])
            blocks[slab].append(block)
            block_slab.append(slab)
        slab_pages = tuple(slab_of_key)
        on_page: list[list[int]] = [[] for _ in range(num_pages)]
        for slab, pages in enumerate(slab_pages):
            for page in pages:
                on_page[page].append(slab)
        sizes = Counter(len(b) for b in blocks)
        widths = Counter(len(p) for p in slab_pages)
        set_ = object.__setattr__
        set_(self, "block_slab", tuple(block_slab))
        set_(self, "num_blocks", geometry.num_blocks)
        set_(self, "num_pages", num_pages)
        set_(self, "page_size", page_size)
        set_(self, "page_slabs", tuple(tuple(s) for s in on_page))
        set_(self, "slab_blocks", tuple(tuple(b) for b in blocks))
        set_(self, "slab_pages", slab_pages)
        set_(self, "typical_slab_blocks", sizes.most_common(1)[0][0])
        set_(self, "typical_slab_pages", widths.most_common(1)[0][0])

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PageMap is immutable")

    @property
    def num_slabs(self) -> int:
        return len(self.slab_pages)

    def pages_of_block(self, block: int) -> tuple[int, ...]:
        """Sorted page indices ``block`` touches."""
        return self.slab_pages[self.block_slab[block]]

    def blocks_on_page(self, page: int) -> list[int]:
        """Every block that touches ``page`` (sorted)."""
        return sorted(b for s in self.page_slabs[page] for b in self.slab_blocks[s])

    def pages_of_blocks(self, blocks: Iterable[int]) -> set[int]:
        """The union of the pages under ``blocks``."""
        slabs = {self.block_slab[b] for b in blocks}
        return {p for s in slabs for p in self.slab_pages[s]}

    def live_blocks_per_page(self, live: Iterable[int]) -> dict[int, int]:
        """Page → number of ``live`` blocks on it (the page refcount), for pages with any."""
        counts: Counter[int] = Counter()
        for block in live:
            counts.update(self.pages_of_block(block))
        return dict(counts)
