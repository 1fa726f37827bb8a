"""Contract: our transfer geometry agrees with vLLM 0.28's ``TransferTopology``.

vLLM 0.28's ``TransferTopology`` asks the attention backend for its cache shape and asserts
it is blocks-first and, for non-MLA attention, the standard 4-D ``[B, H, N, C]``. Real
backends (``AttentionBackendEnum``) go in; we must refuse exactly the ones it asserts on
(legacy split K/V: ROCM_ATTN's ``(2, B, N, H, D)``, HPC_ATTN's ``(B, 2, N, H, D)``) and plan
the rest. Its ``tp_ratio`` / replication and ``compute_tp_mapping`` source ranks match ours.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.utils import (
    EngineTransferInfo,
    TransferTopology,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec

from elastickv.geometry import GeometryError, KVCacheGeometry, RemoteSide, TPTopology, plan_transfer

# Backend -> our kind; each backend's shape family as the 0.28 contract tests map it.
BACKENDS = {
    "CPU_ATTN": "packed",
    "TRITON_ATTN": "packed",
    "FLEX_ATTENTION": "packed",
    "TRITON_MLA": "mla",
    "ROCM_ATTN": "split_kv",
    "HPC_ATTN": "split_kv_block_first",
}


def _topology(backend: type, tp: int = 1, rank: int = 0, heads: int = 2, mla: bool = False):  # type: ignore[no-untyped-def]
    return TransferTopology(
        tp_rank=rank,
        tp_size=tp,
        block_size=16,
        engine_id="local",
        is_mla=mla,
        is_mamba=False,
        total_num_kv_heads=heads,
        attn_backends=[backend],
    )


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_refused_exactly_where_transfer_topology_asserts(name: str) -> None:
    backend = AttentionBackendEnum[name].get_class()
    kind = BACKENDS[name]
    mla = kind == "mla"
    try:
        _topology(backend, heads=1 if mla else 2, mla=mla)
        vllm_refuses = False
    except AssertionError:
        vllm_refuses = True
    g = KVCacheGeometry(2, 4, 1 if mla else 2, 16, 64, kind=kind, layout="NHD", contract="0.28")
    try:
        plan_transfer(g, RemoteSide(1))
        we_refuse = False
    except GeometryError as err:
        we_refuse = True
        assert err.field == "kind" and "packed" in str(err)
    assert vllm_refuses == we_refuse == kind.startswith("split")


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from((1, 2, 4, 8)), st.sampled_from((1, 2, 4)), st.sampled_from((1, 2, 4)), st.data()
)
def test_ranks_match_compute_tp_mapping(
    heads: int, local_tp: int, remote_tp: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, local_tp - 1))
    topo = _topology(AttentionBackendEnum["CPU_ATTN"].get_class(), local_tp, rank, heads)
    topo.register_remote_engine(
        "remote",
        EngineTransferInfo(
            remote_tp_size=remote_tp,
            remote_block_len=0,
            remote_block_size=16,
            remote_physical_blocks_per_logical=1,
        ),
    )
    ours = TPTopology(local_tp, remote_tp, heads)
    mapping = compute_tp_mapping(topo, remote_tp, (FullAttentionSpec,))
    assert topo.tp_ratio(remote_tp) == ours.tp_ratio
    assert topo.is_kv_replicated("remote") == ours.replicated(remote_tp)
    assert mapping.source_ranks_per_group[0] == tuple(s.remote_rank for s in ours.slices(rank))
