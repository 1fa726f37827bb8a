"""Contract: our transfer geometry is what vLLM 0.32's NIXL connector computes.

vLLM side, its own code called without an engine: ``TransferTopology`` (tp ratio, KV
replication) and ``compute_tp_mapping`` (source ranks, head-slot index, rank offset factor);
the NIXL worker's descriptor builders ``_build_fa_local``, ``_build_fa_remote`` and
``_build_local_splits_from_plan``, called as plain functions on a stand-in worker that holds
the per-region ``(base, block_len, block_stride)`` NIXL registers. That registration step
(``register_kv_caches``) needs a live NIXL agent, so the test reproduces its rule for the
block-contiguous layouts NIXL allows for heterogeneous TP: base = the layer view's
``data_ptr()``, length = page / kernel-block ratio, stride = ``stride(0)`` in bytes.

Our side: ``TPTopology.slices`` and ``TransferPlan.transfers`` over backings whose views
are built by ``build_layer_views``; every descriptor address and length must be equal.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.utils import (
    EngineTransferInfo,
    TransferTopology,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker as Worker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from elastickv.geometry import (
    KVCacheGeometry,
    RemoteSide,
    TPTopology,
    build_layer_views,
    plan_transfer,
    slot_regions,
)
from elastickv.integrations.vllm.transfer import kv_read_hold, kv_transfer

TPS = (1, 2, 4, 8)


def _vllm(local_tp: int, rank: int, remote_tp: int, heads: int, mla: bool) -> TransferTopology:
    topo = TransferTopology(
        tp_rank=rank,
        tp_size=local_tp,
        block_size=16,
        engine_id="local",
        is_mla=mla,
        is_mamba=False,
        total_num_kv_heads=1 if mla else heads,
        attn_backends=[],
    )
    info = EngineTransferInfo(
        remote_tp_size=remote_tp,
        remote_block_len=0,
        remote_block_size=16,
        remote_physical_blocks_per_logical=1,
    )
    topo.register_remote_engine("remote", info)
    return topo


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from((1, 2, 4, 8)),
    st.sampled_from(TPS),
    st.sampled_from(TPS),
    st.booleans(),
    st.data(),
)
def test_slices_match_transfer_topology_and_compute_tp_mapping(
    heads: int, local_tp: int, remote_tp: int, mla: bool, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, local_tp - 1))
    ours = TPTopology(local_tp, remote_tp, 1 if mla else heads, mla)
    topo = _vllm(local_tp, rank, remote_tp, heads, mla)
    mapping = compute_tp_mapping(topo, remote_tp, (FullAttentionSpec,))
    slices = ours.slices(rank)
    assert topo.tp_ratio(remote_tp) == ours.tp_ratio
    assert topo.replicates_kv_cache("remote") == ours.replicated(remote_tp)
    assert topo.local_replicates_kv_cache == ours.replicated(local_tp)
    assert topo.local_physical_heads == ours.heads_per_rank(local_tp)
    assert mapping.source_ranks_per_group[0] == tuple(s.remote_rank for s in slices)
    assert set(topo.handshake_target_ranks(remote_tp)) >= {s.remote_rank for s in slices}
    local_heads = ours.heads_per_rank(local_tp)
    for s in slices:
        if ours.replicated(remote_tp):  # NIXL reads replicated regions whole, at offset 0
            assert s.remote_whole
        elif local_tp >= remote_tp:  # remote offset = factor x local block_len
            assert s.remote_slots == (
                mapping.rank_offset_factor * local_heads,
                (mapping.rank_offset_factor + 1) * local_heads,
            )
        if local_tp < remote_tp and not ours.replicated(local_tp):
            chunk = local_heads // len(mapping.source_ranks_per_group[0])
            slot = mapping.rank_to_attention_slot[s.remote_rank]
            assert s.local_slots == (slot * chunk, (slot + 1) * chunk)


def _registration(g: KVCacheGeometry, backing: torch.Tensor) -> tuple[list[int], int, list[int]]:
    """NIXL's per-layer regions over our views: bases, block_len, strides."""
    views = build_layer_views(g, backing)
    bases = [v.data_ptr() for v in views]
    strides = [v.stride(0) * v.element_size() for v in views]
    return bases, g.page_bytes // g.kernel_ratio, strides


def _worker(g: KVCacheGeometry, backing: torch.Tensor, topo: TransferTopology, mla: bool) -> Any:
    bases, block_len, strides = _registration(g, backing)
    stub = types.SimpleNamespace(
        transfer_topo=topo,
        device_id=0,
        _transfer_layer_region_indices=(),
        block_len_per_layer=[block_len] * g.num_layers,
        block_stride_per_layer=strides,
        region_num_blocks=[g.num_kernel_blocks] * g.num_layers,
        num_regions=g.num_layers,
        _group_spec_types=(FullAttentionSpec,),
        _is_region_replicated=lambda i: mla,
        _logical_num_blocks=g.num_blocks,
        _ple_region_index=None,
        _stack_descs=Worker._stack_descs,
    )
    stub._fa_desc_replicated = types.MethodType(Worker._fa_desc_replicated, stub)
    stub.bases = bases
    return stub


@st.composite
def cases(draw: st.DrawFn) -> tuple[KVCacheGeometry, int, int, int, int, bool]:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from((1, 2, 4)))
    local_tp, remote_tp = draw(st.sampled_from(TPS[:3])), draw(st.sampled_from(TPS[:3]))
    layout = draw(st.sampled_from(("LBHNC", "BLHNC")))  # NIXL's block-contiguous layouts
    assert KVCacheLayout[layout].is_block_contiguous
    layers = draw(st.integers(1, 3))
    ratio = 1 if layout == "BLHNC" and layers > 1 else draw(st.sampled_from((1, 2)))
    g = KVCacheGeometry(
        num_layers=layers,
        num_blocks=draw(st.integers(2, 5)),
        num_kv_heads=max(1, heads // local_tp),
        block_size=4 * ratio,
        kernel_block_size=4,
        head_size=8,
        dtype="float16",
        layout=layout,
        kind="mla" if mla else "packed",
    )
    rank = draw(st.integers(0, local_tp - 1))
    return g, heads, local_tp, remote_tp, rank, mla


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_descriptors_match_the_nixl_worker(
    case: tuple[KVCacheGeometry, int, int, int, int, bool], data: st.DataObject
) -> None:
    g, heads, local_tp, remote_tp, rank, mla = case
    plan = plan_transfer(
        g, RemoteSide(remote_tp), local_tp=local_tp, local_rank=rank, total_kv_heads=heads
    )
    topo = _vllm(local_tp, rank, remote_tp, heads, mla)
    mapping = compute_tp_mapping(topo, remote_tp, (FullAttentionSpec,))
    local_backing = torch.zeros(g.backing_bytes, dtype=torch.uint8)
    local = _worker(g, local_backing, topo, mla)
    remote_backings = {
        s.remote_rank: torch.zeros(plan.remote.backing_bytes, dtype=torch.uint8)
        for s in plan.slices
    }
    block = data.draw(st.integers(0, g.num_blocks - 1))
    remote_block = data.draw(st.integers(0, g.num_blocks - 1))
    src = Worker._build_fa_local(local, local.bases, 1)
    if topo.tp_ratio(remote_tp) < 0 and not mla:
        splits = list(Worker._build_local_splits_from_plan(local, mapping, src, len(src), 1))
        by_rank = dict(zip(mapping.all_source_ranks, splits, strict=True))
    else:
        by_rank = {s.remote_rank: src.tolist() for s in plan.slices}
    ours = {
        (x.remote_rank, x.local.layer, x.local.kernel_block): x
        for x in plan.transfers(block, remote_block)
    }
    assert len(ours) == len(plan.transfers(block, remote_block))  # one region per key
    kr = g.kernel_ratio
    for remote_rank, backing in remote_backings.items():
        bases, _, strides = _registration(plan.remote, backing)
        meta = types.SimpleNamespace(
            kv_caches_base_addr=bases,
            region_num_blocks=None,
            num_blocks=plan.remote.num_kernel_blocks,
            device_id=0,
            block_strides=strides,
        )
        dst = Worker._build_fa_remote(local, mapping, meta, 1)
        for layer in range(g.num_layers):
            for j in range(kr):
                x = ours[(remote_rank, layer, j)]
                addr, length, _ = by_rank[remote_rank][layer * g.num_kernel_blocks + block * kr + j]
                assert (addr, length) == (local_backing.data_ptr() + x.local.offset, x.local.length)
                index = layer * plan.remote.num_kernel_blocks + remote_block * kr + j
                addr, length, _ = (int(v) for v in dst[index])
                assert (addr, length) == (backing.data_ptr() + x.remote.offset, x.remote.length)


def test_nixl_refuses_head_slices_exactly_where_a_slice_is_not_one_run() -> None:
    """A two-head slice of one rank's block is one byte run only for the layouts vLLM's
    ``is_block_contiguous`` lets NIXL slice (it refuses the rest for heterogeneous TP)."""
    for layout in KVCacheLayout:
        g = KVCacheGeometry(2, 3, 4, 4, 8, layout=layout.name)
        one_run = len(slot_regions(g, 1, (2, 4), layer=0)) == 1
        assert one_run == layout.is_block_contiguous, layout


# -- the NIXL handshake guard: mismatched caches are refused before anything is registered ----


def _remote_meta(**changes: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    fields: dict[str, Any] = {
        "engine_id": "prefill-engine",
        "agent_metadata": b"",
        "kv_caches_base_addr": [0],
        "device_id": 0,
        "num_blocks": 8,
        "block_lens": [8192],
        "block_strides": [8192],
        "kv_cache_layout": "NHD",
        "block_size": 32,
        "ssm_sizes": (0, 0),
        "attn_backend_name": "CPU_ATTN",
        "physical_blocks_per_logical_kv_block": 1,
    }
    fields.update(changes)
    return NixlAgentMetadata(**fields)


def _local_worker(**changes: Any) -> types.SimpleNamespace:
    fields: dict[str, Any] = {
        "block_size": 32,
        "_physical_blocks_per_logical_kv_block": 1,
        "kv_cache_layout": "NHD",
        "block_len_per_layer": [8192],
        "transfer_tp_size": 1,
    }
    fields.update(changes)
    return types.SimpleNamespace(**fields)


def test_nixl_guard_wraps_add_remote_agent_with_its_signature() -> None:
    original = Worker.add_remote_agent
    assert list(inspect.signature(original).parameters) == [
        "self",
        "nixl_agent_meta",
        "remote_tp_rank",
        "remote_tp_size",
        "remote_dcp_size",
    ]
    assert kv_transfer.install_nixl_guard()
    kv_transfer.install_nixl_guard()  # idempotent
    wrapped = Worker.add_remote_agent
    assert wrapped.__elastickv_original__ is original
    # Refused before vLLM's own code runs (a stand-in worker would fail there).
    with pytest.raises(kv_transfer.KVTransferMismatch, match="this engine 64, remote engine 32"):
        wrapped(_local_worker(block_size=64, block_len_per_layer=[16384]), _remote_meta(), 0, 1)


def test_nixl_guard_names_what_differs() -> None:
    mismatches = kv_transfer.mismatches

    assert mismatches(_local_worker(), _remote_meta(), 1) == []
    assert mismatches(_local_worker(block_size=64), _remote_meta(), 1) == [
        "block size: this engine 64, remote engine 32"
    ]
    # The same logical block split into other kernel blocks.
    split = _local_worker(block_size=16, _physical_blocks_per_logical_kv_block=2)
    assert mismatches(split, _remote_meta(), 1) == [
        "kernel block size: this engine 16, remote engine 32"
    ]
    assert mismatches(_local_worker(kv_cache_layout="HND"), _remote_meta(), 1) == [
        "KV cache layout: this engine HND, remote engine NHD"
    ]
    wider = _local_worker(block_len_per_layer=[16384])
    assert mismatches(wider, _remote_meta(), 1) == [
        "bytes per block (head size, heads or dtype): this engine 16384, remote engine 8192"
    ]
    # Heterogeneous TP: a block holds another number of heads on each side.
    assert mismatches(wider, _remote_meta(), 2) == []


def test_nixl_guard_installs_through_the_connector_factory() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kv_transfer.wrap_classmethod(
        KVConnectorFactory, "create_connector", kv_transfer._after_create(60.0)
    )
    kv_transfer.install()
    descriptor = KVConnectorFactory.__dict__["create_connector"]
    assert isinstance(descriptor, classmethod)
    assert hasattr(descriptor.__func__, "__elastickv_original__")
    with pytest.raises(ValueError, match="kv_transfer_config must be set"):
        KVConnectorFactory.create_connector(
            types.SimpleNamespace(kv_transfer_config=None), None, None
        )


def _sending_worker(leases: dict[str, float]) -> types.SimpleNamespace:
    """The state vLLM's ``_reap_expired_send_leases`` reads on a prefill-side NIXL worker."""
    return types.SimpleNamespace(
        _reqs_to_send=leases,
        _reqs_to_process=set(leases),
        consumer_notification_counts_by_req={},
        expected_consumer_notifications_by_req=dict.fromkeys(leases, 1),
        xfer_stats=types.SimpleNamespace(record_kv_expired_req=lambda: None),
    )


def test_an_unread_lease_is_held_before_vllm_reaps_it() -> None:
    import time

    reap = Worker._reap_expired_send_leases
    original = getattr(reap, "__elastickv_original__", reap)  # another test may have installed
    assert list(inspect.signature(original).parameters) == ["self", "done_sending"]
    assert kv_transfer.install_nixl_guard()
    reap = Worker._reap_expired_send_leases
    assert reap.__elastickv_original__ is original
    now = time.perf_counter()
    worker = _sending_worker({"late": now - 1.0, "fresh": now + 100.0})
    done: set[str] = set()
    reap(worker, done)  # vLLM's own reaper, under the hold
    assert done == set()
    # Held for the default hold (the first install in a process sets it).
    assert worker._reqs_to_send["late"] == pytest.approx(now - 1.0 + kv_read_hold.DEFAULT_HOLD_S)
    worker._reqs_to_send["late"] = now - 0.5  # the hold ran out
    reap(worker, done)
    assert done == {"late"} and set(worker._reqs_to_send) == {"fresh"}


def test_a_lease_ending_before_vllms_own_clock_read_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's reaper reads ``time.perf_counter()`` after the hook: a lease that ends in between
    was freed unheld (an engine waiting for pages steps in a tight loop, and leases set in one
    step end microseconds apart). Here vLLM's clock runs half a second ahead of the hook's."""
    import time

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    assert kv_transfer.install_nixl_guard()
    later = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + 0.5)
    monkeypatch.setattr(base_worker, "time", later)
    now = time.perf_counter()
    worker = _sending_worker({"edge": now + 0.3})
    done: set[str] = set()
    Worker._reap_expired_send_leases(worker, done)
    assert done == set()
    assert worker._reqs_to_send["edge"] == pytest.approx(now + 0.3 + kv_read_hold.DEFAULT_HOLD_S)


def test_the_prefill_response_says_until_when_its_blocks_are_kept() -> None:
    import time

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

    kv_transfer.install_nixl_guard()
    read_by_key = kv_read_hold.READ_BY_KEY
    params = {"do_remote_prefill": True, "remote_request_id": "p-1"}
    scheduler = types.SimpleNamespace(
        _kv_lease_duration=30, request_finished=lambda request, block_ids: (True, dict(params))
    )
    connector = types.SimpleNamespace(connector_scheduler=scheduler)
    before = time.time()
    delay, out = NixlBaseConnector.request_finished(connector, object(), [1, 2])
    assert delay is True and out is not None
    promised = 30.0 + kv_read_hold.DEFAULT_HOLD_S  # the lease and the hold
    assert before + promised <= out[read_by_key] <= time.time() + promised
    _, out = NixlBaseConnector.request_finished_all_groups(connector, object(), ([1, 2],))
    assert out is not None and read_by_key in out
    # Blocks freed at once (an abort, a decode-side request): nothing to promise.
    scheduler.request_finished = lambda request, block_ids: (False, dict(params))
    _, out = NixlBaseConnector.request_finished(connector, object(), [1])
    assert out is not None and read_by_key not in out


def test_a_decoder_past_the_read_by_time_computes_the_prompt_itself() -> None:
    import time

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )

    kv_transfer.install_nixl_guard()
    pull = types.SimpleNamespace(
        _get_remote_prefill_token_count=lambda n: n, kv_recompute_threshold=0
    )
    scheduler = types.SimpleNamespace(
        get_num_new_matched_tokens=lambda request, computed: (
            NixlPullConnectorScheduler.get_num_new_matched_tokens(pull, request, computed)
        )
    )
    connector = types.SimpleNamespace(connector_scheduler=scheduler)

    def request(read_by: float) -> types.SimpleNamespace:
        params = {
            "do_remote_prefill": True,
            "remote_request_id": "p-1",
            kv_read_hold.READ_BY_KEY: read_by,
        }
        return types.SimpleNamespace(
            request_id="d-1", prompt_token_ids=list(range(70)), kv_transfer_params=params
        )

    fresh = request(time.time() + 60.0)
    assert NixlBaseConnector.get_num_new_matched_tokens(connector, fresh, 0) == (70, True)
    late = request(time.time() + 1.0)  # within the margin: may be gone when the read lands
    assert NixlBaseConnector.get_num_new_matched_tokens(connector, late, 0) == (0, False)
    assert late.kv_transfer_params["do_remote_prefill"] is False
