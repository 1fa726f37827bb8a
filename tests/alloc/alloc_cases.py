"""Small geometries over the layouts the allocator must handle, and a commit-failure injector."""

from __future__ import annotations

from collections.abc import Iterable

from elastickv.geometry import KVCacheGeometry, vllm028_layout
from elastickv.vmm import CommitError, VirtualRange

PAGE = 64 * 1024


def small_geometries() -> dict[str, KVCacheGeometry]:
    """Each exercises a different block → page shape at 64 KiB pages."""
    return {
        # 8 KiB per (layer, block): 8 blocks share one page in each layer.
        "per_layer_hnd": KVCacheGeometry(
            num_layers=2, num_blocks=40, num_kv_heads=2, block_size=16, head_size=64
        ),
        # 12 KiB per (layer, block): blocks straddle page boundaries.
        "per_layer_nhd_straddle": KVCacheGeometry(
            num_layers=3, num_blocks=30, num_kv_heads=3, block_size=16, head_size=64, layout="NHD"
        ),
        # Block outermost, 36 KiB per block across 3 layers: a block spans up to two pages
        # and neighbouring blocks share the boundary page.
        "cross_layer_straddle": KVCacheGeometry(
            num_layers=3,
            num_blocks=30,
            num_kv_heads=3,
            block_size=16,
            head_size=64,
            layout=vllm028_layout("NHD", cross_layer=True),
            contract="0.28",
        ),
        # Block outermost, 96 KiB per block: every block spans two pages.
        "cross_layer_wide": KVCacheGeometry(
            num_layers=3, num_blocks=16, num_kv_heads=4, block_size=16, head_size=64, layout="BLHNC"
        ),
        # Padded pages: 8 KiB of content in a 9 KiB page.
        "padded": KVCacheGeometry(
            num_layers=2,
            num_blocks=40,
            num_kv_heads=2,
            block_size=16,
            head_size=64,
            page_size_padded=9 * 1024,
        ),
        # Head planes outside blocks: one block touches a page in every (layer, head) plane.
        "head_planes": KVCacheGeometry(
            num_layers=2, num_blocks=40, num_kv_heads=2, block_size=16, head_size=64, layout="LHBNC"
        ),
        # Kernel blocks of half the logical block.
        "kernel_ratio_2": KVCacheGeometry(
            num_layers=2,
            num_blocks=40,
            num_kv_heads=2,
            block_size=16,
            head_size=64,
            kernel_block_size=8,
        ),
    }


class FailingCommits:
    """Wraps a range's ``commit``: when armed, commits the first ``after`` pages for real and
    then raises ``CommitError``, like a backend failing mid-way through a batch."""

    def __init__(self, vrange: VirtualRange) -> None:
        self.vrange = vrange
        self.real = vrange.commit
        self.armed: int | None = None
        self.fired = 0
        vrange.commit = self.commit  # type: ignore[method-assign]

    def arm(self, after: int) -> None:
        self.armed = after

    def commit(self, pages: Iterable[int]) -> int:
        if self.armed is None:
            return self.real(pages)
        after, self.armed = self.armed, None
        wanted = sorted(pages)
        done = self.real(wanted[:after]) if after else 0
        self.fired += 1
        raise CommitError(f"injected failure after {done} of {len(wanted)} pages")
