"""Transfer geometry: exactly which bytes a KV connector moves for a block, and between whom.

Prefill/decode disaggregation moves finished blocks from one engine's cache into another's.
vLLM's connectors (NIXL, MoRIIO) move one region per (layer, block) — K and V are packed in
the row, so they are never split — and, when the two engines run different tensor-parallel
(TP) sizes, a head-range slice of a block. This module computes those regions from a
:class:`KVCacheGeometry`, so an elastic store knows exactly which pages a transfer reads or
lands in, and a refusal happens here (with what to change) instead of as wrong tokens.

Terms: a *region* is one contiguous byte run of a backing; a (layer, kernel block) is one
region when its head slots and tokens are dense, otherwise several (head planes outside
blocks, ``LHBNC``/``BHLNC``; a head slice of an ``NHD`` page). A *head slice* pairs one
rank of each side: which head slots of the local block correspond to which head slots of
the remote block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastickv.geometry.content import KVQuant
from elastickv.geometry.errors import GeometryError
from elastickv.geometry.layout import AXIS_B, AXIS_H, AXIS_N, KVLayout
from elastickv.geometry.spec import AttentionKind, Contract, KVCacheGeometry

SlotRange = tuple[int, int]  # [start, end) head slots of one rank's block


@dataclass(frozen=True)
class Region:
    """One contiguous run of a backing: what one transfer descriptor covers.

    It holds head slots ``heads`` × tokens ``tokens`` (of the logical block, so a kernel
    block ``j`` covers tokens from ``j * kernel_block_size``) of ``block`` in ``layer``, at
    bytes ``[offset, offset + length)`` of the backing.
    """

    layer: int
    block: int
    kernel_block: int
    heads: SlotRange
    tokens: SlotRange
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def as_dict(self) -> dict[str, object]:
        return {
            "layer": self.layer,
            "block": self.block,
            "kernel_block": self.kernel_block,
            "heads": list(self.heads),
            "tokens": list(self.tokens),
            "offset": self.offset,
            "length": self.length,
        }


def _transferable(geometry: KVCacheGeometry) -> None:
    """Refuse what vLLM's connectors cannot move as blocks-first caches."""
    if geometry.kind in (AttentionKind.SPLIT_KV, AttentionKind.SPLIT_KV_BLOCK_FIRST):
        raise GeometryError(
            "kind",
            f"legacy split K/V ({geometry.kind.value}) is not a blocks-first [B, H, N, C] "
            "cache; vLLM 0.28's TransferTopology asserts that shape, so KV connectors "
            "cannot move it. Use a packed attention backend",
            [AttentionKind.PACKED.value, AttentionKind.MLA.value],
        )


def block_regions(
    geometry: KVCacheGeometry, block: int, layer: int | None = None
) -> tuple[Region, ...]:
    """The regions of logical ``block`` (one layer, or every layer in order).

    One per (layer, kernel block) when that page is dense; one per head slot where the
    layout keeps head slots outside blocks. They tile :meth:`KVCacheGeometry.
    block_byte_ranges` exactly.
    """
    return slot_regions(geometry, block, (0, geometry.num_head_slots), layer)


def slot_regions(
    geometry: KVCacheGeometry, block: int, slots: SlotRange, layer: int | None = None
) -> tuple[Region, ...]:
    """The regions holding head slots ``slots`` of ``block`` (all tokens), in address order
    within each (layer, kernel block)."""
    _transferable(geometry)
    _check_index("block", block, geometry.num_blocks)
    start, stop = slots
    if not 0 <= start < stop <= geometry.num_head_slots:
        raise GeometryError(
            "slots",
            f"{slots} is not a non-empty range of the {geometry.num_head_slots} head slots",
        )
    layers = range(geometry.num_layers) if layer is None else [layer]
    regions: list[Region] = []
    for lay in layers:
        _check_index("layer", lay, geometry.num_layers)
        for kernel in range(geometry.kernel_ratio):
            regions.extend(_page_runs(geometry, lay, block, kernel, start, stop))
    return tuple(regions)


def _page_runs(
    g: KVCacheGeometry, layer: int, block: int, kernel: int, h0: int, h1: int
) -> list[Region]:
    """Runs of head slots [h0, h1) × all tokens of one (layer, kernel block), merged as far
    as the strides allow (each run stays a heads × tokens rectangle)."""
    strides = g.view_strides
    assert g.kernel_block_size is not None
    tokens, content = g.kernel_block_size, g.row.content_bytes
    sh, sn = strides[AXIS_H], strides[AXIS_N]
    base = g.layer_offset(layer) + (block * g.kernel_ratio + kernel) * strides[AXIS_B]
    first_token = kernel * tokens
    heads = h1 - h0

    def run(ha: int, hb: int, ta: int, tb: int, length: int) -> Region:
        offset = base + ha * sh + ta * sn
        return Region(
            layer, block, kernel, (ha, hb), (first_token + ta, first_token + tb), offset, length
        )

    if tokens == 1 or sn == content:  # a head's tokens are adjacent (HND inside the slot)
        slot_len = tokens * content
        if heads == 1 or sh == slot_len:
            return [run(h0, h1, 0, tokens, heads * slot_len)]
        return [run(h, h + 1, 0, tokens, slot_len) for h in range(h0, h1)]
    if heads == 1 or sh == content:  # a token's heads are adjacent (NHD inside the page)
        token_len = heads * content
        if sn == token_len:
            return [run(h0, h1, 0, tokens, tokens * token_len)]
        return [run(h0, h1, t, t + 1, token_len) for t in range(tokens)]
    return [run(h, h + 1, t, t + 1, content) for h in range(h0, h1) for t in range(tokens)]


# ---------------------------------------------------------------------- tensor parallelism


@dataclass(frozen=True)
class HeadSlice:
    """What one local rank exchanges with one remote rank, per block.

    ``kv_heads`` are the model's KV heads moved (``(0, 1)`` for MLA's latent);
    ``local_slots`` / ``remote_slots`` where they sit in each rank's block. A side whose
    slots are all of its block moves whole blocks.
    """

    local_rank: int
    remote_rank: int
    kv_heads: SlotRange
    local_slots: SlotRange
    remote_slots: SlotRange
    local_whole: bool
    remote_whole: bool

    def as_dict(self) -> dict[str, object]:
        return {
            "local_rank": self.local_rank,
            "remote_rank": self.remote_rank,
            "kv_heads": list(self.kv_heads),
            "local_slots": list(self.local_slots),
            "remote_slots": list(self.remote_slots),
            "local_whole": self.local_whole,
            "remote_whole": self.remote_whole,
        }


@dataclass(frozen=True)
class TPTopology:
    """Which ranks of two TP groups hold which KV heads, and who exchanges with whom.

    The same rules as vLLM's ``TransferTopology`` and NIXL's ``compute_tp_mapping``: each
    rank holds ``total_kv_heads // tp`` heads, or one replicated head when ``tp`` exceeds
    the heads; MLA's latent is replicated on every rank and never sliced.
    """

    local_tp: int
    remote_tp: int
    total_kv_heads: int
    mla: bool = False

    def __post_init__(self) -> None:
        for name in ("local_tp", "remote_tp", "total_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GeometryError(name, f"must be an integer >= 1, got {value!r}")
        big, small = max(self.local_tp, self.remote_tp), min(self.local_tp, self.remote_tp)
        if big % small:
            raise GeometryError(
                "remote_tp",
                f"TP sizes {self.local_tp} (local) and {self.remote_tp} (remote) do not divide "
                "one another, so ranks cannot be paired; use sizes where one is a multiple "
                "of the other",
            )
        if self.mla:
            return
        for name, tp in (("local_tp", self.local_tp), ("remote_tp", self.remote_tp)):
            if (tp <= self.total_kv_heads and self.total_kv_heads % tp) or (
                tp > self.total_kv_heads and tp % self.total_kv_heads
            ):
                raise GeometryError(
                    name,
                    f"TP {tp} does not split {self.total_kv_heads} KV heads evenly (one must "
                    "divide the other)",
                    [
                        d
                        for d in range(1, 2 * self.total_kv_heads + 1)
                        if _splits(d, self.total_kv_heads)
                    ],
                )

    @property
    def tp_ratio(self) -> int:
        """vLLM's signed ratio: ``local // remote``, or ``-(remote // local)`` when smaller."""
        if self.local_tp >= self.remote_tp:
            return self.local_tp // self.remote_tp
        return -(self.remote_tp // self.local_tp)

    def heads_per_rank(self, tp: int) -> int:
        return 1 if self.mla else max(1, self.total_kv_heads // tp)

    def replicated(self, tp: int) -> bool:
        """Whether ranks of a TP-``tp`` side hold copies rather than disjoint heads."""
        return self.mla or tp > self.total_kv_heads

    def kv_heads(self, tp: int, rank: int) -> SlotRange:
        """The model's KV heads rank ``rank`` of a TP-``tp`` group holds."""
        _check_index("rank", rank, tp)
        if self.mla:
            return (0, 1)
        if tp > self.total_kv_heads:
            head = rank * self.total_kv_heads // tp
            return (head, head + 1)
        per = self.total_kv_heads // tp
        return (rank * per, (rank + 1) * per)

    def slices(self, local_rank: int) -> tuple[HeadSlice, ...]:
        """Every remote rank ``local_rank`` exchanges with, and which head slots.

        Local TP >= remote TP: one remote rank, whose block holds ours (a head slice of it
        unless heads are replicated there). Local TP < remote TP: several remote ranks each
        fill a slice of our block; ranks holding a copy of a head already taken are skipped.
        """
        local_heads = self.kv_heads(self.local_tp, local_rank)
        if self.mla or self.local_tp >= self.remote_tp:
            remote_ranks = [local_rank * self.remote_tp // self.local_tp]
        else:
            ratio = self.remote_tp // self.local_tp
            seen: set[int] = set()
            remote_ranks = []
            for rank in range(local_rank * ratio, (local_rank + 1) * ratio):
                head = self.kv_heads(self.remote_tp, rank)[0]
                if head not in seen:
                    seen.add(head)
                    remote_ranks.append(rank)
        out = []
        for remote_rank in remote_ranks:
            remote_heads = self.kv_heads(self.remote_tp, remote_rank)
            heads = (max(local_heads[0], remote_heads[0]), min(local_heads[1], remote_heads[1]))
            local = (heads[0] - local_heads[0], heads[1] - local_heads[0])
            remote = (heads[0] - remote_heads[0], heads[1] - remote_heads[0])
            out.append(
                HeadSlice(
                    local_rank,
                    remote_rank,
                    heads,
                    local,
                    remote,
                    local == (0, local_heads[1] - local_heads[0]),
                    remote == (0, remote_heads[1] - remote_heads[0]),
                )
            )
        return tuple(out)

    def as_dict(self) -> dict[str, object]:
        return {
            "local_tp": self.local_tp,
            "remote_tp": self.remote_tp,
            "total_kv_heads": self.total_kv_heads,
            "mla": self.mla,
            "tp_ratio": self.tp_ratio,
            "local_replicated": self.replicated(self.local_tp),
            "remote_replicated": self.replicated(self.remote_tp),
        }


def _splits(tp: int, heads: int) -> bool:
    return heads % tp == 0 if tp <= heads else tp % heads == 0


# ---------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RemoteSide:
    """The other engine: its TP size and, when known, one rank's geometry.

    Without ``geometry`` the remote is assumed to be laid out like the local side (same
    layout, dtype, block size) with its own head count, dense strides and no padding.
    """

    tp_size: int
    geometry: KVCacheGeometry | None = None


@dataclass(frozen=True)
class Transfer:
    """One descriptor pair: ``local`` and ``remote`` hold the same bytes, in the same order."""

    remote_rank: int
    local: Region
    remote: Region

    def as_dict(self) -> dict[str, object]:
        return {
            "remote_rank": self.remote_rank,
            "local": self.local.as_dict(),
            "remote": self.remote.as_dict(),
        }


@dataclass(frozen=True)
class TransferPlan:
    """What local rank ``local_rank`` moves per block, with every remote rank it pairs with."""

    local: KVCacheGeometry
    remote: KVCacheGeometry
    topology: TPTopology
    local_rank: int
    slices: tuple[HeadSlice, ...]

    @property
    def whole_blocks(self) -> bool:
        """Both sides move whole blocks (no head slicing on either side)."""
        return all(s.local_whole and s.remote_whole for s in self.slices)

    def transfers(
        self, block: int, remote_block: int | None = None, layer: int | None = None
    ) -> tuple[Transfer, ...]:
        """The descriptor pairs moving local ``block`` to/from ``remote_block`` (default:
        the same id), per layer, per remote rank, per run."""
        remote_block = block if remote_block is None else remote_block
        out: list[Transfer] = []
        for piece in self.slices:
            local = slot_regions(
                self.local, block, _slots(self.local, piece.local_slots, piece.local_whole), layer
            )
            remote = slot_regions(
                self.remote,
                remote_block,
                _slots(self.remote, piece.remote_slots, piece.remote_whole),
                layer,
            )
            out.extend(
                Transfer(piece.remote_rank, a, b)
                for a, b in _pair(self.local, list(local), self.remote, list(remote))
            )
        return tuple(out)

    def as_dict(self, block: int = 0, remote_block: int | None = None) -> dict[str, object]:
        transfers = self.transfers(block, remote_block)
        return {
            "topology": self.topology.as_dict(),
            "local_rank": self.local_rank,
            "whole_blocks": self.whole_blocks,
            "slices": [s.as_dict() for s in self.slices],
            "block": block,
            "remote_block": block if remote_block is None else remote_block,
            "bytes_per_block": sum(t.local.length for t in transfers),
            "transfers": [t.as_dict() for t in transfers],
        }


def _pair(
    lg: KVCacheGeometry, local: list[Region], rg: KVCacheGeometry, remote: list[Region]
) -> list[tuple[Region, Region]]:
    """Pair two runs lists holding the same (head, token) rows in the same order, cutting
    the longer run where the shorter ends (a whole NHD page against a head slice of one)."""
    pairs: list[tuple[Region, Region]] = []
    local, remote = local[::-1], remote[::-1]
    while local and remote:
        a, b = local.pop(), remote.pop()
        n = min(a.length, b.length)
        if a.length > n:
            a, rest = _cut(lg, a, n)
            local.append(rest)
        if b.length > n:
            b, rest = _cut(rg, b, n)
            remote.append(rest)
        pairs.append((a, b))
    if local or remote:
        raise AssertionError(f"unpaired runs: {local} / {remote}")
    return pairs


def _cut(g: KVCacheGeometry, region: Region, length: int) -> tuple[Region, Region]:
    """The first ``length`` bytes of ``region`` and the rest, each a heads × tokens run."""
    (ha, hb), (ta, tb) = region.heads, region.tokens
    content = g.row.content_bytes
    head_major = tb - ta == 1 or (hb - ha > 1 and g.view_strides[AXIS_N] == content)
    unit = (tb - ta) * content if head_major else (hb - ha) * content
    if length % unit:
        raise AssertionError(f"cannot cut {region} at {length} bytes")
    k = length // unit
    if head_major:
        first = dataclasses.replace(region, heads=(ha, ha + k), length=length)
        rest = (ha + k, hb), region.tokens
    else:
        first = dataclasses.replace(region, tokens=(ta, ta + k), length=length)
        rest = region.heads, (ta + k, tb)
    other = dataclasses.replace(
        region,
        heads=rest[0],
        tokens=rest[1],
        offset=region.offset + length,
        length=region.length - length,
    )
    return first, other


def _slots(geometry: KVCacheGeometry, slots: SlotRange, whole: bool) -> SlotRange:
    """Head slots holding KV heads ``slots`` of one rank's block: all of them for a whole
    block (nvfp4 keeps K and V of each head in two slots), MLA's one latent slot."""
    if whole or geometry.kind is AttentionKind.MLA:
        return (0, geometry.num_head_slots)
    return slots


def plan_transfer(
    local: KVCacheGeometry,
    remote: RemoteSide,
    *,
    local_tp: int = 1,
    local_rank: int = 0,
    total_kv_heads: int | None = None,
) -> TransferPlan:
    """The transfer plan of one local rank against a remote TP group.

    ``local`` is one rank's cache (``num_kv_heads`` per rank); ``total_kv_heads`` is the
    model's, by default ``num_kv_heads × local_tp`` (give it when the local side
    replicates heads). Refusals name the field and what to change.
    """
    _transferable(local)
    mla = local.kind is AttentionKind.MLA
    total = total_kv_heads if total_kv_heads is not None else local.num_kv_heads * local_tp
    topology = TPTopology(local_tp, remote.tp_size, 1 if mla else total, mla)
    _check_index("local_rank", local_rank, local_tp)
    if not mla and local.num_kv_heads != topology.heads_per_rank(local_tp):
        raise GeometryError(
            "num_kv_heads",
            f"a TP-{local_tp} rank of a model with {total} KV heads holds "
            f"{topology.heads_per_rank(local_tp)} heads, but the local geometry has "
            f"{local.num_kv_heads}; pass num_kv_heads per rank and total_kv_heads for the "
            "model",
        )
    remote_geometry = _remote_geometry(local, remote, topology)
    slices = topology.slices(local_rank)
    if not all(s.local_whole and s.remote_whole for s in slices):
        _sliceable(local, topology)
    return TransferPlan(local, remote_geometry, topology, local_rank, slices)


def _sliceable(geometry: KVCacheGeometry, topology: TPTopology) -> None:
    """Refuse head slices of caches whose heads are not independent byte ranges."""
    quant = geometry.quant
    if quant is KVQuant.NVFP4 or quant.is_per_token_head:
        why = (
            "nvfp4 stores each side as all data, then all scales, so a head range is not a "
            "byte range"
            if quant is KVQuant.NVFP4
            else f"{quant.value} carries per-token-head scales, which vLLM's connectors move "
            "with whole blocks only"
        )
        raise GeometryError(
            "remote_tp",
            f"TP {topology.local_tp} (local) and {topology.remote_tp} (remote) need head "
            f"slices of each block, but {why}; run both engines with the same TP size",
            [topology.local_tp],
        )


_MATCHING = (
    "contract",
    "kind",
    "layout",
    "quant",
    "storage_dtype",
    "head_size",
    "v_head_size",
    "num_layers",
    "block_size",
    "kernel_block_size",
)


def _remote_geometry(
    local: KVCacheGeometry, remote: RemoteSide, topology: TPTopology
) -> KVCacheGeometry:
    heads = topology.heads_per_rank(remote.tp_size)
    given = remote.geometry
    if given is None:
        if heads == local.num_kv_heads or local.kind is AttentionKind.MLA:
            return local
        return dataclasses.replace(
            local,
            num_kv_heads=heads,
            page_size_padded=None,
            layer_stride=None,
            block_stride=None,
            offset=0,
        )
    _transferable(given)
    for name in _MATCHING:
        mine, theirs = getattr(local, name), getattr(given, name)
        if mine != theirs:
            hint = {
                "block_size": " (vLLM splits a larger block into byte chunks of the smaller "
                "and permutes them as [H, N, C] rows; the CPU kernel's pages are not such "
                "rows, so decode reads wrong tokens without an error)",
                "layout": " (a connector copies bytes; the other side would read them in "
                "another order)",
            }.get(name, "")
            raise GeometryError(
                name,
                f"local {_show(mine)} != remote {_show(theirs)}{hint}; run both engines with "
                f"the same {name}",
            )
    if local.kind is not AttentionKind.MLA and given.num_kv_heads != heads:
        raise GeometryError(
            "num_kv_heads",
            f"a TP-{remote.tp_size} remote rank of a model with {topology.total_kv_heads} KV "
            f"heads holds {heads} heads, but the remote geometry has {given.num_kv_heads}",
        )
    return given


def _show(value: object) -> str:
    if isinstance(value, KVLayout | Contract | AttentionKind | KVQuant):
        return value.name if isinstance(value, KVLayout) else str(value.value)
    return str(value)


def _check_index(name: str, value: int, bound: int) -> None:
    if not 0 <= value < bound:
        raise GeometryError(name, f"{value} is out of range [0, {bound})")
