"""Transfer geometry: regions tile a block's bytes, head slices tile the smaller side's block,
and moving bytes by the plan gives every rank exactly the KV heads it should hold."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from geometry_strategies import (
    MLA,
    PACKED,
    byte_addresses,
    describe,
    fresh_backing,
    geometries,
    kernel_blocks_of,
)
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from elastickv.geometry import (
    AttentionKind,
    GeometryError,
    KVCacheGeometry,
    KVQuant,
    RemoteSide,
    TPTopology,
    block_regions,
    build_layer_views,
    plan_transfer,
    slot_regions,
)
from elastickv.geometry.layout import AXIS_B, AXIS_H, AXIS_N

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TPS = (1, 2, 4, 8)


# ---------------------------------------------------------------------- regions of a block


@SETTINGS
@given(geometries(kinds=(PACKED, MLA)), st.data())
def test_block_regions_tile_the_block_exactly(g: KVCacheGeometry, data: st.DataObject) -> None:
    """Disjoint, inside the backing, union = the block's bytes; each region is exactly the
    bytes its (kernel block, heads, tokens) rectangle covers in the engine's view."""
    block = data.draw(st.integers(0, g.num_blocks - 1))
    backing = fresh_backing(g)
    views = build_layer_views(g, backing)
    for layer in range(g.num_layers):
        regions = block_regions(g, block, layer)
        spans = sorted((r.offset, r.end) for r in regions)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, f"overlap in {describe(g)}"
        assert all(s >= 0 and e <= g.backing_bytes for s, e in spans)
        covered = torch.zeros(g.backing_bytes, dtype=torch.bool)
        for s, e in spans:
            covered[s:e] = True
        expected = torch.zeros_like(covered)
        for s, e in g.block_byte_ranges(block, layer):
            expected[s:e] = True
        assert torch.equal(covered, expected), describe(g)
        kernel_views = kernel_blocks_of(g, views[layer], block)
        assert g.kernel_block_size is not None
        for r in regions:
            view = kernel_views[r.kernel_block]
            if view.dim() == 2:  # 0.28 MLA: (N, C) without a head axis
                view = view.unsqueeze(0)
            t0 = r.tokens[0] - r.kernel_block * g.kernel_block_size
            t1 = r.tokens[1] - r.kernel_block * g.kernel_block_size
            cell = view[r.heads[0] : r.heads[1], t0:t1]
            got = byte_addresses(cell, backing)
            assert got.numel() == r.length
            assert torch.equal(got.sort().values, torch.arange(r.offset, r.end)), r


@SETTINGS
@given(geometries(kinds=(PACKED,)), st.data())
def test_slot_regions_of_a_partition_tile_the_block(
    g: KVCacheGeometry, data: st.DataObject
) -> None:
    """Cutting the head slots anywhere gives regions that together are the whole block."""
    cut = data.draw(st.integers(1, g.num_head_slots))
    block = data.draw(st.integers(0, g.num_blocks - 1))
    parts = [slot_regions(g, block, (0, cut))]
    if cut < g.num_head_slots:
        parts.append(slot_regions(g, block, (cut, g.num_head_slots)))
    ranges = sorted((r.offset, r.end) for part in parts for r in part)
    whole = sorted((r.offset, r.end) for r in block_regions(g, block))
    assert _merged(ranges) == _merged(whole)
    assert sum(e - s for s, e in ranges) == sum(e - s for s, e in whole)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in ranges:
        if out and s == out[-1][1]:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def test_one_region_per_layer_block_for_dense_pages() -> None:
    """HND and NHD per layer: a block of a layer is one run; LHBNC: one per head slot."""
    for layout, runs in (("HND", 1), ("NHD", 1), ("BLHNC", 1), ("LHBNC", 4), ("BHLNC", 4)):
        g = KVCacheGeometry(3, 5, 4, 8, 16, layout=layout)
        assert len(block_regions(g, 2)) == 3 * runs, layout
        assert {r.length for r in block_regions(g, 2)} == {g.page_bytes // runs}


def test_kernel_block_split_gives_one_region_per_kernel_block() -> None:
    g = KVCacheGeometry(2, 4, 2, 16, 8, layout="HND", kernel_block_size=4)
    regions = block_regions(g, 1, layer=0)
    assert [r.kernel_block for r in regions] == [0, 1, 2, 3]
    assert [r.tokens for r in regions] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert [r.length for r in regions] == [g.page_bytes // 4] * 4
    assert [r.offset for r in regions] == [g.page_bytes * (1 + j / 4) for j in range(4)]


@pytest.mark.parametrize("kind", ["split_kv", "split_kv_block_first"])
def test_legacy_split_kv_is_refused(kind: str) -> None:
    g = KVCacheGeometry(2, 4, 2, 4, 8, kind=kind, layout="NHD", contract="0.28")
    with pytest.raises(GeometryError, match="blocks-first") as err:
        block_regions(g, 0)
    assert err.value.field == "kind"
    with pytest.raises(GeometryError, match="packed"):
        plan_transfer(g, RemoteSide(1))


# ---------------------------------------------------------------------- TP head slices


@st.composite
def topologies(draw: st.DrawFn) -> TPTopology:
    heads = draw(st.sampled_from((1, 2, 4, 8)))
    local, remote = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    return TPTopology(local, remote, heads, mla=draw(st.booleans()) and heads == 1)


@settings(max_examples=300, deadline=None)
@given(topologies())
def test_head_slices_of_the_larger_side_tile_the_smaller_sides_block(t: TPTopology) -> None:
    big = max(t.local_tp, t.remote_tp)
    small = min(t.local_tp, t.remote_tp)
    # Larger-side rank -> (smaller-side rank, slots of the smaller side's block).
    pieces: dict[int, set[tuple[int, int]]] = {q: set() for q in range(small)}
    if t.local_tp >= t.remote_tp:
        for rank in range(big):
            (s,) = t.slices(rank)
            assert s.local_whole and s.local_slots == (0, t.heads_per_rank(t.local_tp))
            pieces[s.remote_rank].add(s.remote_slots)
            assert s.kv_heads == t.kv_heads(t.local_tp, rank)
    else:
        for rank in range(small):
            slices = t.slices(rank)
            assert all(s.remote_whole for s in slices)
            pieces[rank] = {s.local_slots for s in slices}
            assert len(pieces[rank]) == len(slices)  # no head read twice
            group = range(rank * (big // small), (rank + 1) * (big // small))
            assert {s.remote_rank for s in slices} <= set(group)
            taken = {t.kv_heads(big, s.remote_rank) for s in slices}
            assert {t.kv_heads(big, q) for q in group} == taken  # every head is read
    for q, slots in pieces.items():
        covered = sorted(slots)
        assert covered[0][0] == 0 and covered[-1][1] == t.heads_per_rank(small), (q, covered)
        for (_, end), (start, _) in itertools.pairwise(covered):
            assert end == start, (q, covered)  # no gap, no overlap


def test_replication_when_tp_exceeds_kv_heads() -> None:
    # 2 KV heads, decode TP 4 reading from prefill TP 1: ranks 0,1 hold head 0; 2,3 head 1.
    t = TPTopology(local_tp=4, remote_tp=1, total_kv_heads=2)
    assert t.replicated(4) and not t.replicated(1)
    assert [t.slices(r)[0].remote_slots for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # Prefill TP 4 -> decode TP 1: the copies on ranks 1 and 3 are not read again.
    t = TPTopology(local_tp=1, remote_tp=4, total_kv_heads=2)
    assert [(s.remote_rank, s.local_slots) for s in t.slices(0)] == [(0, (0, 1)), (2, (1, 2))]
    # Both sides replicated: whole blocks, same head.
    t = TPTopology(local_tp=8, remote_tp=4, total_kv_heads=2)
    assert all(s.remote_whole and s.local_whole for r in range(8) for s in t.slices(r))
    assert [t.slices(r)[0].remote_rank for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_mla_is_never_sliced() -> None:
    g = KVCacheGeometry(2, 4, 1, 4, 32, kind="mla")
    for local_tp, remote_tp in ((1, 4), (4, 1), (2, 8)):
        for rank in range(local_tp):
            plan = plan_transfer(g, RemoteSide(remote_tp), local_tp=local_tp, local_rank=rank)
            (s,) = plan.slices
            assert plan.whole_blocks and s.remote_rank == rank * remote_tp // local_tp
            assert sum(x.local.length for x in plan.transfers(1)) == 2 * g.page_bytes


def test_indivisible_tp_is_refused() -> None:
    with pytest.raises(GeometryError, match="do not divide") as err:
        TPTopology(3, 2, 6)
    assert err.value.field == "remote_tp"
    with pytest.raises(GeometryError, match="does not split 4 KV heads") as err:
        TPTopology(1, 3, 4)
    assert err.value.field == "remote_tp" and err.value.accepted == (1, 2, 4, 8)


# ---------------------------------------------------------------------- moving bytes


def _byte_view(g: KVCacheGeometry, backing: torch.Tensor, layer: int) -> torch.Tensor:
    """[B', H, N', C] bytes of one layer straight from the geometry's strides."""
    _, blocks, heads, tokens, content = g.view_shape
    s = g.view_strides
    return torch.as_strided(
        backing,
        (blocks, heads, tokens, content),
        (s[AXIS_B], s[AXIS_H], s[AXIS_N], 1),
        g.layer_offset(layer),
    )


def _fill(g: KVCacheGeometry, backing: torch.Tensor, first_head: int) -> None:
    """Every byte names (layer, global head slot, logical token, byte): what must arrive."""
    _, blocks, heads, tokens, content = g.view_shape
    ratio = g.kernel_ratio
    kb = torch.arange(blocks)[:, None, None, None]
    slot = torch.arange(heads)[None, :, None, None] + first_head
    token = (kb % ratio) * tokens + torch.arange(tokens)[None, None, :, None]
    byte = torch.arange(content)[None, None, None, :]
    for layer in range(g.num_layers):
        value = (layer * 7919 + slot * 104729 + token * 1299709 + byte * 15485863) % 251 + 1
        _byte_view(g, backing, layer).copy_(
            value.to(torch.uint8).expand(blocks, heads, tokens, content)
        )


@st.composite
def plans(draw: st.DrawFn) -> tuple[KVCacheGeometry, int, int, int]:
    g = draw(geometries(kinds=(PACKED, MLA), overrides=False))
    local, remote = draw(st.sampled_from(TPS[:3])), draw(st.sampled_from(TPS[:3]))
    if g.kind is AttentionKind.MLA:
        return g, local, remote, 1
    per_rank = g.num_kv_heads
    if g.quant is KVQuant.NVFP4 or g.quant.is_per_token_head:
        remote = local  # whole blocks only
    total = per_rank * local
    if per_rank == 1 and draw(st.booleans()):
        total = max(1, local // draw(st.sampled_from((1, 2, 4))))  # local replicates heads
    if not (total % remote == 0 if remote <= total else remote % total == 0):
        remote = local
    return g, local, remote, total


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(), st.data())
def test_moving_bytes_by_the_plan_gives_each_rank_its_heads(
    case: tuple[KVCacheGeometry, int, int, int], data: st.DataObject
) -> None:
    g, local_tp, remote_tp, total = case
    rank = data.draw(st.integers(0, local_tp - 1))
    try:
        plan = plan_transfer(
            g, RemoteSide(remote_tp), local_tp=local_tp, local_rank=rank, total_kv_heads=total
        )
    except GeometryError as exc:
        # The remote side's geometry is one no engine runs: a layout that keeps head slots
        # outside the layer axis (BHLNC) splits blocks into kernel blocks with one head per
        # rank only, and the remote holds more. Planning refuses it, naming the field.
        assert exc.field == "kernel_block_size" and g.kernel_ratio > 1, exc
        reject()
    t = plan.topology
    mla = g.kind is AttentionKind.MLA
    block = data.draw(st.integers(0, g.num_blocks - 1))
    remote_block = data.draw(st.integers(0, plan.remote.num_blocks - 1))
    local = fresh_backing(g)
    expected = fresh_backing(g)
    _fill(g, expected, 0 if mla else t.kv_heads(local_tp, rank)[0])
    remotes = {}
    for s in plan.slices:
        remotes[s.remote_rank] = fresh_backing(plan.remote)
        _fill(
            plan.remote,
            remotes[s.remote_rank],
            0 if mla else t.kv_heads(remote_tp, s.remote_rank)[0],
        )
    moved = 0
    for x in plan.transfers(block, remote_block):
        assert x.local.length == x.remote.length
        assert x.local.heads[1] - x.local.heads[0] == x.remote.heads[1] - x.remote.heads[0]
        assert x.local.tokens == x.remote.tokens
        local[x.local.offset : x.local.end] = remotes[x.remote_rank][x.remote.offset : x.remote.end]
        moved += x.local.length
    assert moved == g.page_bytes * g.num_layers  # every byte of the block, once
    for start, end in g.block_byte_ranges(block):
        assert torch.equal(local[start:end], expected[start:end]), describe(g)
    outside = torch.ones(g.backing_bytes, dtype=torch.bool)
    for start, end in g.block_byte_ranges(block):
        outside[start:end] = False
    assert not local[outside].any()


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("dtype", ["nvfp4", "int8_per_token_head", "fp8_per_token_head"])
def test_quantized_scales_move_whole_blocks_only(dtype: str) -> None:
    g = KVCacheGeometry(2, 4, 2, 4, 32, kv_cache_dtype=dtype, layout="HND")
    with pytest.raises(GeometryError, match="same TP size") as err:
        plan_transfer(g, RemoteSide(2))
    assert err.value.field == "remote_tp" and err.value.accepted == (1,)
    with pytest.raises(GeometryError, match="same TP size"):
        plan_transfer(g, RemoteSide(1), local_tp=2, local_rank=1)
    assert plan_transfer(g, RemoteSide(1)).whole_blocks
    assert plan_transfer(g, RemoteSide(2), local_tp=2, local_rank=1).whole_blocks


def test_mismatched_remote_geometry_is_refused_naming_both_values() -> None:
    g = KVCacheGeometry(2, 8, 2, 32, 16, layout="HND")
    with pytest.raises(GeometryError, match=r"local 32 != remote 64.*wrong tokens") as err:
        plan_transfer(g, RemoteSide(1, dataclasses.replace(g, block_size=64)))
    assert err.value.field == "block_size"
    with pytest.raises(GeometryError, match="local LBHNC != remote LBNHC") as err:
        plan_transfer(g, RemoteSide(1, dataclasses.replace(g, layout="NHD")))
    assert err.value.field == "layout"
    with pytest.raises(GeometryError, match="holds 1 heads, but the remote geometry has 2"):
        plan_transfer(g, RemoteSide(2, g))
    remote = dataclasses.replace(g, num_blocks=3, offset=64)  # other capacity: fine
    plan = plan_transfer(g, RemoteSide(1, remote))
    assert plan.transfers(0, 2)[0].remote.offset == 64 + 2 * g.page_bytes


def test_local_heads_must_match_the_topology() -> None:
    g = KVCacheGeometry(2, 8, 4, 16, 16, layout="HND")
    with pytest.raises(GeometryError, match="holds 2 heads, but the local geometry has 4") as err:
        plan_transfer(g, RemoteSide(1), local_tp=2, total_kv_heads=4)
    assert err.value.field == "num_kv_heads"
    with pytest.raises(GeometryError, match="local_rank: 2 is out of range"):
        plan_transfer(g, RemoteSide(1), local_tp=2, local_rank=2)
