"""One engine's elastic KV storage as its scheduler sees it: the geometry, the page grants
its workers follow, and the capacity policy that admits every page.

The engine core builds it from its workers' exports (:mod:`.kv_export`) once they placed
their KV caches, and publishes it through :data:`REGISTRY` — the one piece of module state
the plugin needs — for the scheduler's :class:`ElasticBlockPool`. It holds no memory: each
worker maps the pages granted here in its own range (see :mod:`elastickv.vmm.grants`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from elastickv.alloc import BlockAllocator, CapacityPolicy, FixedBudget, Unlimited
from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.vmm.base import round_up
from elastickv.vmm.grants import PageGrants

# The engine's config and the ledger device its pages are charged to (``host`` or
# ``cuda-<UUID>``) → the policy admitting them.
PolicyFactory = Callable[[ElasticConfig, str], CapacityPolicy]


def default_policy(config: ElasticConfig, device: str) -> CapacityPolicy:
    """The engine's ledger record on ``device`` (registered now, in the scheduler's process):
    every page is admitted from credit under its live limit (``ELASTICKV_BUDGET`` at start)
    and the device budget."""
    from elastickv.integrations.vllm.engine.registration import register_engine

    return register_engine(config, device).policy


def local_policy(config: ElasticConfig, device: str) -> CapacityPolicy:
    """Without the ledger: a local byte budget when one is set (a percentage is of this
    host's physical memory, there being no device budget), else unlimited (counted)."""
    del device
    if config.budget_bytes is not None:
        return FixedBudget(config.budget_bytes)
    if config.budget_percent is not None:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return FixedBudget(int(physical * config.budget_percent / 100))
    return Unlimited()


@dataclass(frozen=True)
class ElasticStore:
    """The scheduler's side of one engine's KV cache (immutable; the grants are its state)."""

    config: ElasticConfig
    geometry: KVCacheGeometry
    vmm_range: PageGrants
    policy: CapacityPolicy
    size_bytes: int
    device: str

    @classmethod
    def for_workers(
        cls,
        config: ElasticConfig,
        geometry: KVCacheGeometry,
        size_bytes: int,
        ranks: int,
        device: str,
        policy_factory: PolicyFactory,
    ) -> ElasticStore:
        """Page grants for ``ranks`` workers each holding ``size_bytes`` in ``geometry``."""
        if geometry.backing_bytes > size_bytes:
            raise ElasticKVStartupError(
                f"the workers' KV pools ({size_bytes} bytes) are smaller than their geometry "
                f"needs ({geometry.backing_bytes})"
            )
        # Each worker commits the null block's pages when it places its KV cache.
        held = geometry.block_pages(0, config.page_size)
        grants = PageGrants(round_up(size_bytes, config.page_size), config.page_size, ranks, held)
        return cls(config, geometry, grants, policy_factory(config, device), size_bytes, device)

    def make_allocator(self) -> BlockAllocator:
        """The allocator the scheduler's block pool places blocks with (block 0 = null)."""
        return BlockAllocator(
            self.geometry,
            self.vmm_range,
            self.policy,
            min_hot_pages=self.config.hot_min_pages,
            max_hot_pages=self.config.hot_max_pages,
            reserve_null_block=True,
        )

    @property
    def ranks(self) -> int:
        """Worker ranks that each map every granted page (tensor parallelism)."""
        return self.vmm_range.ranks


class StoreRegistry:
    """The store of the engine in this process (one engine per process while elastic)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: ElasticStore | None = None

    def publish(self, store: ElasticStore) -> None:
        with self._lock:
            self._store = store

    def current(self) -> ElasticStore | None:
        with self._lock:
            return self._store

    def require(self) -> ElasticStore:
        store = self.current()
        if store is None:
            raise ElasticKVStartupError(
                "the scheduler found no elastic KV storage in this process: the engine core "
                "did not attach to its worker's KV pool (is the elastickv plugin loaded in "
                "every vLLM process?)"
            )
        return store


REGISTRY = StoreRegistry()
