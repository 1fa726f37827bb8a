"""What a geometry costs in mapped pages: the facts ``elastickv layout explain`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastickv.geometry.layout import KVLayout
from elastickv.geometry.spec import AttentionKind, Contract, KVCacheGeometry
from elastickv.geometry.views import LayerView, layer_views

DEFAULT_PAGE_SIZE = 2 << 20  # the CUDA VMM granularity and our default mapping unit
_SAMPLED_BLOCKS = 64


@dataclass(frozen=True)
class LayoutReport:
    """Per-layer views plus the per-block facts that decide memory cost.

    ``blocks_per_page`` is how many logical blocks of one layer share one mapped page;
    ``pages_per_block`` the most pages any (sampled) block touches across all layers.
    """

    geometry: KVCacheGeometry
    page_size: int
    layers: list[LayerView]
    backing_bytes: int
    block_bytes_per_layer: int
    padded_block_bytes_per_layer: int
    block_stride: int
    layer_stride: int
    runs_per_block_per_layer: int
    blocks_per_page: float
    pages_per_block: int
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        g = self.geometry
        return {
            "contract": Contract.parse(g.contract).value,
            "layout": KVLayout.parse(g.layout).name,
            "kind": AttentionKind.parse(g.kind).value,
            "kv_cache_dtype": g.quant.value,
            "num_layers": g.num_layers,
            "num_blocks": g.num_blocks,
            "block_size": g.block_size,
            "kernel_block_size": g.kernel_block_size,
            "layers": [v.as_dict() for v in self.layers],
            "backing_bytes": self.backing_bytes,
            "block_bytes_per_layer": self.block_bytes_per_layer,
            "padded_block_bytes_per_layer": self.padded_block_bytes_per_layer,
            "block_stride": self.block_stride,
            "layer_stride": self.layer_stride,
            "runs_per_block_per_layer": self.runs_per_block_per_layer,
            "page_size": self.page_size,
            "blocks_per_page": self.blocks_per_page,
            "pages_per_block": self.pages_per_block,
            "warnings": list(self.warnings),
        }


def explain(geometry: KVCacheGeometry, page_size: int = DEFAULT_PAGE_SIZE) -> LayoutReport:
    """Measure ``geometry`` against mapping pages of ``page_size`` bytes."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    layout = KVLayout.parse(geometry.layout)
    stride = geometry.block_stride_bytes
    sample = range(min(geometry.num_blocks, _SAMPLED_BLOCKS))
    pages_per_block = max(len(geometry.block_pages(b, page_size)) for b in sample)
    runs = len(geometry.block_byte_ranges(0, layer=0))
    warnings: list[str] = []
    cross_layer = not layout.is_layer_outermost and geometry.num_layers > 1
    if cross_layer and stride >= page_size:
        warnings.append(
            f"{layout.name} puts all {geometry.num_layers} layers of a block together "
            f"(block stride {stride} B >= page {page_size} B): every attention read of one "
            "layer's block lands on a different page. kvcached measured -31% throughput "
            "for this cross-layer storage; prefer a per-layer layout (LBHNC/LBNHC)."
        )
    if runs > 1:
        warnings.append(
            f"one block of one layer is {runs} separate byte runs ({layout.name} keeps head "
            "slots outside blocks): transfers need one region per run."
        )
    return LayoutReport(
        geometry=geometry,
        page_size=page_size,
        layers=layer_views(geometry),
        backing_bytes=geometry.backing_bytes,
        block_bytes_per_layer=geometry.page_bytes,
        padded_block_bytes_per_layer=geometry.padded_page_bytes,
        block_stride=stride,
        layer_stride=geometry.layer_stride_bytes,
        runs_per_block_per_layer=runs,
        blocks_per_page=page_size / stride,
        pages_per_block=pages_per_block,
        warnings=warnings,
    )
