"""ElasticKVCache: registration is part of creating a cache; limits reach the allocator."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastickv.cache import ElasticKVCache
from elastickv.control import list_instances, open_ledger, set_limit
from elastickv.geometry import KVCacheGeometry, split_kv
from elastickv.vmm import HostBackend

PAGE = 64 << 10
MIB = 1 << 20


def geometry() -> KVCacheGeometry:
    # 2 layers x 4 KiB per block: one 64 KiB page per layer holds 16 blocks.
    return KVCacheGeometry(
        num_layers=2, num_blocks=64, num_kv_heads=2, block_size=16, head_size=16,
        dtype="float32", layout="HND",
    )  # fmt: skip


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("ELASTICKV_LEDGER_DIR", str(tmp_path))
    return str(tmp_path)


def test_create_registers_and_close_unregisters(ledger_dir: str) -> None:
    with ElasticKVCache(geometry(), backend=HostBackend(PAGE), name="demo-a") as cache:
        names = {i.name for i in list_instances("host", directory=ledger_dir)}
        assert names == {"demo-a"}
        assert cache.info().committed_bytes == 2 * PAGE  # the null block's page per layer
        assert cache.footprint_bytes() == 2 * PAGE
        blocks = cache.allocate(20)
        assert blocks is not None and 0 not in blocks
        # Values written through the engine views land in committed memory.
        k, _ = split_kv(cache.geometry, cache.views[0])
        k[blocks[0]].fill_(1.5)
        assert float(k[blocks[0]].sum()) == 1.5 * k[blocks[0]].numel()
        assert cache.footprint_bytes() == cache.info().committed_bytes
        cache.free(blocks)
    assert list_instances("host", directory=ledger_dir) == []


def test_a_lowered_limit_drops_the_hot_reserve_and_restore_regrows(ledger_dir: str) -> None:
    with ElasticKVCache(
        geometry(), backend=HostBackend(PAGE), name="demo-b", max_hot_pages=8
    ) as cache:
        blocks = cache.allocate(40)  # three slabs: 6 pages
        assert blocks is not None
        cache.free(blocks)  # pages stay hot (max 8)
        assert cache.footprint_bytes() == 6 * PAGE
        revision = set_limit("demo-b", 2 * PAGE, directory=ledger_dir)
        assert cache.sync_limit() == 4  # the engine's per-step call drops the reserve
        assert cache.footprint_bytes() == 2 * PAGE  # the null block's pages only
        assert cache.allocate(40) is None  # growth over the limit: "not now"
        assert cache.sync_limit() == 0
        set_limit("demo-b", None, expected_revision=revision, directory=ledger_dir)
        again = cache.allocate(40)
        assert again is not None
        assert cache.footprint_bytes() == 6 * PAGE


def test_failed_creation_leaves_no_registration(ledger_dir: str) -> None:
    with open_ledger("host", directory=ledger_dir) as ledger:
        ledger.register("taken")
        with pytest.raises(Exception, match="taken"):
            ElasticKVCache(geometry(), backend=HostBackend(PAGE), ledger=ledger, name="taken")
        assert [i.name for i in ledger.list_instances()] == ["taken"]
