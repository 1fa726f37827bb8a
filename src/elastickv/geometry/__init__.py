"""The layout geometry core: one exact description of where every KV-cache byte lives.

Pure: it touches no memory except to build views over a backing it is given.
"""

from elastickv.geometry.content import KV_CACHE_DTYPES, KVQuant, RowFormat
from elastickv.geometry.errors import GeometryError
from elastickv.geometry.layout import (
    LAYOUT_NAMES,
    KVLayout,
    layout_from_stride_order,
    vllm028_layout,
)
from elastickv.geometry.spec import (
    AttentionKind,
    ByteRange,
    Contract,
    KVCacheGeometry,
    merge_ranges,
)
from elastickv.geometry.transfer import (
    HeadSlice,
    Region,
    RemoteSide,
    TPTopology,
    Transfer,
    TransferPlan,
    block_regions,
    plan_transfer,
    slot_regions,
)
from elastickv.geometry.views import (
    LayerView,
    build_layer_views,
    layer_view,
    layer_views,
    nvfp4_data_scale,
    scale_views,
    split_kv,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "LAYOUT_NAMES",
    "AttentionKind",
    "ByteRange",
    "Contract",
    "GeometryError",
    "HeadSlice",
    "KVCacheGeometry",
    "KVLayout",
    "KVQuant",
    "LayerView",
    "Region",
    "RemoteSide",
    "RowFormat",
    "TPTopology",
    "Transfer",
    "TransferPlan",
    "block_regions",
    "build_layer_views",
    "layer_view",
    "layer_views",
    "layout_from_stride_order",
    "merge_ranges",
    "nvfp4_data_scale",
    "plan_transfer",
    "scale_views",
    "slot_regions",
    "split_kv",
    "vllm028_layout",
]
