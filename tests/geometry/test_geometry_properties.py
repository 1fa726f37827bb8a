"""Properties of the geometry core over random geometries in every layout and kind.

Every property is stated over backing *bytes*: the views are built over a real flat byte
tensor and the bytes each element covers are read back off the tensors' own shape, stride
and storage offset (``byte_addresses``), so the properties check what an engine would
actually read and write, not the arithmetic that produced the strides.
"""

from __future__ import annotations

import itertools

import torch
from geometry_strategies import (
    byte_addresses,
    byte_counts,
    byte_mask,
    describe,
    fresh_backing,
    geometries,
    kernel_blocks_of,
    ranges_mask,
    unsplit,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastickv.geometry import (
    AttentionKind,
    Contract,
    KVCacheGeometry,
    KVLayout,
    KVQuant,
    build_layer_views,
    layer_views,
    nvfp4_data_scale,
    scale_views,
    split_kv,
)

PROPERTY = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")


def _patterned_backing(geometry: KVCacheGeometry, lead: int = 0) -> torch.Tensor:
    """A backing full of distinct-looking bytes (seeded), so equal reads mean equal bytes."""
    generator = torch.Generator().manual_seed(geometry.backing_bytes)
    storage = torch.randint(
        0, 256, (lead + geometry.backing_bytes,), dtype=torch.uint8, generator=generator
    )
    return storage[lead:]


def _raw_bytes(view: torch.Tensor) -> torch.Tensor:
    """The bytes of ``view`` in element order, little-endian within each element."""
    return view.contiguous().view(torch.uint8).reshape(-1)


def _has_kv_split(geometry: KVCacheGeometry) -> bool:
    return geometry.kind is not AttentionKind.MLA


# ------------------------------------------------------------------------ injectivity


@PROPERTY
@given(geometry=geometries())
def test_views_are_injective_and_inside_the_backing(geometry: KVCacheGeometry) -> None:
    backing = fresh_backing(geometry)
    size = geometry.backing_bytes
    views = build_layer_views(geometry, backing)
    assert len(views) == geometry.num_layers
    per_layer = [byte_addresses(view, backing) for view in views]
    everything = torch.cat(per_layer)
    assert int(everything.min()) >= geometry.offset, describe(geometry)
    assert int(everything.max()) < size, describe(geometry)
    counts = byte_counts(per_layer, size)
    assert int(counts.max()) == 1, f"two elements share a byte: {describe(geometry)}"
    # Every layer holds exactly its pages' content.
    expected = geometry.num_blocks * geometry.page_bytes
    assert all(part.numel() == expected for part in per_layer)

    if not _has_kv_split(geometry):
        return
    for view, layer_bytes in zip(views, per_layer, strict=True):
        k, v = split_kv(geometry, view)
        sides = [byte_addresses(k, backing), byte_addresses(v, backing)]
        if geometry.quant.is_per_token_head:
            sides += [byte_addresses(s, backing) for s in scale_views(geometry, view)]
        side_counts = byte_counts(sides, size)
        assert int(side_counts.max()) == 1, f"K and V share a byte: {describe(geometry)}"
        # K, V (and their scales) are exactly the layer's bytes: nothing left over.
        assert torch.equal(side_counts.bool(), byte_mask([layer_bytes], size))


@PROPERTY
@given(geometry=geometries(overrides=False))
def test_default_strides_pack_pages_densely(geometry: KVCacheGeometry) -> None:
    """Without stride overrides: backing = offset + L·B·padded page, pages back to back."""
    layers, blocks = geometry.num_layers, geometry.num_blocks
    padded = geometry.padded_page_bytes
    assert geometry.backing_bytes == geometry.offset + layers * blocks * padded
    backing = fresh_backing(geometry)
    touched = byte_mask(
        [byte_addresses(v, backing) for v in build_layer_views(geometry, backing)],
        geometry.backing_bytes,
    )
    assert int(touched.sum()) == layers * blocks * geometry.page_bytes
    if geometry.page_size_padded is None:
        assert bool(touched[geometry.offset :].all()), "holes in an unpadded cache"
    # Each layout's axes really nest in its named order (outermost = largest stride).
    layout = geometry.layout
    assert isinstance(layout, KVLayout)
    strides = [
        geometry.view_strides[axis] for axis in layout.order if geometry.view_shape[axis] > 1
    ]
    assert strides == sorted(strides, reverse=True), describe(geometry)


# ------------------------------------------------------------------------ blocks


@PROPERTY
@given(geometry=geometries())
def test_block_byte_ranges_are_the_bytes_the_block_views_touch(
    geometry: KVCacheGeometry,
) -> None:
    backing = fresh_backing(geometry)
    size = geometry.backing_bytes
    views = build_layer_views(geometry, backing)
    for block in range(geometry.num_blocks):
        every_layer = torch.zeros(size, dtype=torch.bool)
        for layer, view in enumerate(views):
            touched = byte_mask(
                [byte_addresses(kb, backing) for kb in kernel_blocks_of(geometry, view, block)],
                size,
            )
            ranges = geometry.block_byte_ranges(block, layer)
            assert torch.equal(touched, ranges_mask(ranges, size)), (
                f"block {block} layer {layer}: {describe(geometry)}"
            )
            assert sum(end - start for start, end in ranges) == geometry.page_bytes
            first = geometry.layer_offset(layer) + block * geometry.block_stride_bytes
            assert ranges[0][0] == first
            every_layer |= touched
        ranges = geometry.block_byte_ranges(block)
        assert torch.equal(every_layer, ranges_mask(ranges, size))
        # Sorted, non-empty and merged: no two runs touch.
        assert all(start < end for start, end in ranges)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges))


@PROPERTY
@given(geometry=geometries(kernel_split=True))
def test_kernel_block_views_partition_their_logical_block(geometry: KVCacheGeometry) -> None:
    ratio = geometry.kernel_ratio
    assert ratio in (2, 4)
    logical = unsplit(geometry)
    # Splitting blocks never moves or resizes the cache.
    assert logical.backing_bytes == geometry.backing_bytes
    backing = fresh_backing(geometry)
    size = geometry.backing_bytes
    kernel_views = build_layer_views(geometry, backing)
    logical_views = build_layer_views(logical, backing)
    axis = 1 if geometry.kind is AttentionKind.SPLIT_KV else 0
    for view in kernel_views:
        assert view.shape[axis] == geometry.num_blocks * ratio
    # 0.28 cross-layer caches lay kernel blocks out afresh across all layers: a logical
    # block is the same bytes, but each layer's share of them moves.
    per_layer = geometry.contract is Contract.V032 or (
        isinstance(geometry.layout, KVLayout) and geometry.layout.is_layer_outermost
    )
    groups = (
        [[layer] for layer in range(geometry.num_layers)]
        if per_layer
        else [list(range(geometry.num_layers))]
    )
    for block in range(geometry.num_blocks):
        for layers in groups:
            pieces = [
                byte_addresses(kb, backing)
                for layer in layers
                for kb in kernel_blocks_of(geometry, kernel_views[layer], block)
            ]
            whole = [
                byte_addresses(logical_views[layer].select(axis, block), backing)
                for layer in layers
            ]
            counts = byte_counts(pieces, size)
            assert int(counts.max()) == 1, "kernel blocks of one logical block overlap"
            assert torch.equal(counts.bool(), byte_mask(whole, size)), (
                f"block {block} layers {layers}: {describe(geometry)}"
            )
        assert geometry.block_byte_ranges(block) == logical.block_byte_ranges(block)


@PROPERTY
@given(geometry=geometries(), data=st.data())
def test_block_pages_are_the_pages_of_the_block_bytes(
    geometry: KVCacheGeometry, data: st.DataObject
) -> None:
    page_size = data.draw(
        st.one_of(st.sampled_from([1, 2, 16, 64, 4096, 2 << 20]), st.integers(1, 700)),
        label="page_size",
    )
    backing = fresh_backing(geometry)
    views = build_layer_views(geometry, backing)
    for block in range(geometry.num_blocks):
        touched = torch.cat(
            [
                byte_addresses(kb, backing)
                for view in views
                for kb in kernel_blocks_of(geometry, view, block)
            ]
        )
        expected = sorted({int(p) for p in torch.unique(touched // page_size)})
        assert geometry.block_pages(block, page_size) == expected


# ------------------------------------------------------------------------ K / V


STORAGE_DTYPES = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
}


def _expected_storage_dtype(geometry: KVCacheGeometry) -> torch.dtype:
    """vLLM's element dtype: the model dtype, int8 for int8 scales, else uint8 bytes."""
    if geometry.quant is KVQuant.NONE:
        return STORAGE_DTYPES[geometry.dtype]
    if geometry.quant is KVQuant.INT8_PER_TOKEN_HEAD:
        return torch.int8
    return torch.uint8


@PROPERTY
@given(geometry=geometries(kinds=("packed", "split_kv", "split_kv_block_first")))
def test_split_kv_returns_the_documented_halves(geometry: KVCacheGeometry) -> None:
    backing = _patterned_backing(geometry)
    heads, tokens = geometry.num_kv_heads, geometry.view_shape[3]  # N': kernel block
    blocks = geometry.num_kernel_blocks
    dk, dv = geometry.head_size, geometry.v_head_size
    assert geometry.storage_dtype == _expected_storage_dtype(geometry)
    for view in build_layer_views(geometry, backing):
        k, v = split_kv(geometry, view)
        if geometry.kind is AttentionKind.SPLIT_KV:
            expected_k, expected_v = view[0], view[1]  # (2, B, N, H, D)
            k_shape = v_shape = (blocks, tokens, heads, dk)
        elif geometry.kind is AttentionKind.SPLIT_KV_BLOCK_FIRST:
            expected_k, expected_v = view[:, 0], view[:, 1]  # (B, 2, N, H, D)
            k_shape = v_shape = (blocks, tokens, heads, dk)
        elif geometry.quant is KVQuant.NVFP4:
            # Heads [0, H) are K, [H, 2H) are V: (B, 2H, N, D/2 + D/16).
            assert tuple(view.shape) == (blocks, 2 * heads, tokens, dk // 2 + dk // 16)
            expected_k, expected_v = view[:, :heads], view[:, heads:]
            k_shape = v_shape = (blocks, heads, tokens, dk // 2 + dk // 16)
        else:
            # vLLM: kv_cache.transpose(1, 2).split(..., dim=-1): [K | V] per row, or
            # [K data | fp32 scale | V data | fp32 scale] with D/2 data bytes for int4.
            rows = view.transpose(1, 2)
            per = 2 if geometry.quant is KVQuant.INT4_PER_TOKEN_HEAD else 1
            k_shape, v_shape = (
                (blocks, tokens, heads, dk // per),
                (blocks, tokens, heads, dv // per),
            )
            if geometry.quant.is_per_token_head:
                cuts = [dk // per, 4, dv // per, 4]
                assert tuple(rows.shape[-1:]) == (sum(cuts),), describe(geometry)
                expected_k, _, expected_v, _ = torch.split(rows, cuts, dim=-1)
            else:
                assert tuple(rows.shape[-1:]) == (dk + dv,), describe(geometry)
                expected_k, expected_v = torch.split(rows, [dk, dv], dim=-1)
            if dk == dv and not geometry.quant.is_per_token_head:
                literal_k, literal_v = torch.split(rows, dk, dim=-1)  # vLLM's exact call
                assert _same_view(k, literal_k) and _same_view(v, literal_v)
        assert (tuple(k.shape), tuple(v.shape)) == (k_shape, v_shape), describe(geometry)
        for got, expected in ((k, expected_k), (v, expected_v)):
            assert _same_view(got, expected), describe(geometry)
            # What the tensor reads is the backing's bytes at the addresses it covers.
            assert torch.equal(_raw_bytes(got), backing[byte_addresses(got, backing)])


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


@PROPERTY
@given(geometry=geometries(kv_cache_dtypes=PER_TOKEN_HEAD))
def test_scale_views_write_exactly_the_documented_row_offsets(
    geometry: KVCacheGeometry,
) -> None:
    # The documented row: [K data | fp32 scale | V data | fp32 scale], int4 data is D/2 bytes.
    per = 2 if geometry.quant is KVQuant.INT4_PER_TOKEN_HEAD else 1
    k_data, v_data = geometry.head_size // per, geometry.v_head_size // per
    row = geometry.row
    assert row.k_scale_offset is not None and row.v_scale_offset is not None
    assert (row.k_offset, row.k_bytes, row.k_scale_offset) == (0, k_data, k_data)
    assert (row.v_offset, row.v_bytes) == (k_data + 4, v_data)
    assert row.v_scale_offset == k_data + 4 + v_data
    assert row.content_bytes == k_data + v_data + 8
    backing = fresh_backing(geometry)
    size = geometry.backing_bytes
    for view in build_layer_views(geometry, backing):
        k_scale, v_scale = scale_views(geometry, view)
        shape = (geometry.num_kernel_blocks, geometry.num_kv_heads, geometry.view_shape[3])
        assert tuple(k_scale.shape) == shape and tuple(v_scale.shape) == shape
        assert k_scale.dtype == torch.float32 == v_scale.dtype
        count = k_scale.numel()
        values = torch.arange(1, count + 1, dtype=torch.float32).reshape(shape)
        before = backing.clone()
        k_scale.copy_(values)
        v_scale.copy_(-values)
        # Row starts, in (B, H, N) order: the first byte of each row of the view.
        starts = byte_addresses(view[..., 0], backing)
        for offset, expected in ((row.k_scale_offset, values), (row.v_scale_offset, -values)):
            at = (starts + offset)[:, None] + torch.arange(4)
            assert torch.equal(backing[at].view(torch.float32).reshape(shape), expected)
        scale_bytes = byte_mask(
            [
                ((starts + offset)[:, None] + torch.arange(4)).reshape(-1)
                for offset in (row.k_scale_offset, row.v_scale_offset)
            ],
            size,
        )
        changed = backing != before
        assert not bool((changed & ~scale_bytes).any()), "a scale write touched data bytes"
        k, v = split_kv(geometry, view)
        data = byte_mask([byte_addresses(k, backing), byte_addresses(v, backing)], size)
        assert not bool((data & scale_bytes).any())
        assert bool((backing[data] == 0).all())


@PROPERTY
@given(geometry=geometries(kv_cache_dtypes=("nvfp4",)))
def test_nvfp4_data_and_scales_partition_each_side(geometry: KVCacheGeometry) -> None:
    head_size = geometry.head_size
    heads, tokens = geometry.num_kv_heads, geometry.view_shape[3]  # N': kernel block
    assert geometry.row.content_bytes == head_size // 2 + head_size // 16
    backing = _patterned_backing(geometry)
    size = geometry.backing_bytes
    for view in build_layer_views(geometry, backing):
        for side in split_kv(geometry, view):
            data, scale = nvfp4_data_scale(side)
            assert data.shape[-1] == head_size // 2 and scale.shape[-1] == head_size // 16
            parts = [byte_addresses(data, backing), byte_addresses(scale, backing)]
            counts = byte_counts(parts, size)
            assert int(counts.max()) == 1, describe(geometry)
            assert torch.equal(counts.bool(), byte_mask([byte_addresses(side, backing)], size))
            for part in (data, scale):
                assert torch.equal(_raw_bytes(part), backing[byte_addresses(part, backing)])
            # Per kernel block: one run of all the side's data, then one run of its scales.
            for kb in range(geometry.num_kernel_blocks):
                side_bytes = byte_addresses(side[kb], backing)
                start = int(side_bytes.min())
                data_end = start + heads * tokens * (head_size // 2)
                end = start + heads * tokens * geometry.row.content_bytes
                assert int(side_bytes.max()) + 1 == end
                got_data = torch.sort(byte_addresses(data[kb], backing)).values
                got_scale = torch.sort(byte_addresses(scale[kb], backing)).values
                assert torch.equal(got_data, torch.arange(start, data_end))
                assert torch.equal(got_scale, torch.arange(data_end, end))


# ------------------------------------------------------------------------ zero copy


@PROPERTY
@given(geometry=geometries(), lead_units=st.integers(0, 3))
def test_build_layer_views_never_copies(geometry: KVCacheGeometry, lead_units: int) -> None:
    """Views share the backing's memory, match ``layer_views`` and write through."""
    lead = 16 * lead_units  # a backing that is a slice of a larger allocation
    storage = torch.zeros(lead + geometry.backing_bytes, dtype=torch.uint8)
    backing = storage[lead:]
    described = layer_views(geometry)
    views = build_layer_views(geometry, backing)
    expected = torch.zeros_like(backing)
    for layer, (view, spec) in enumerate(zip(views, described, strict=True)):
        assert view.untyped_storage().data_ptr() == backing.untyped_storage().data_ptr()
        esize = view.element_size()
        assert view.dtype == spec.dtype == geometry.storage_dtype
        assert tuple(view.shape) == spec.shape and view.stride() == spec.stride
        assert view.storage_offset() * esize == lead + spec.storage_offset * esize
        view.view(torch.uint8).fill_(layer + 1)
        expected[byte_addresses(view, backing)] = layer + 1
    assert torch.equal(backing, expected), "a write through a view missed the backing"
    assert not bool(storage[:lead].any()), "a view wrote before the backing"
