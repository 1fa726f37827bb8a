"""One engine's elastic KV storage: the host range behind vLLM's KV tensor, its geometry, and
the capacity policy that admits every page commit.

In-process the worker creates it (it allocates the KV tensor) and the scheduler's block pool
builds its block allocator over it, both through :data:`REGISTRY` — the one piece of module
state the plugin needs. In multiprocess mode the engine core builds its own store over the
worker's pool (:mod:`elastickv.integrations.vllm.shared_pool`) and publishes it the same way.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from elastickv.alloc import BlockAllocator, CapacityPolicy, FixedBudget, Unlimited
from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.vmm import HostBackend, ShardedRange, VirtualRange

PolicyFactory = Callable[[ElasticConfig], CapacityPolicy]


def default_policy(config: ElasticConfig) -> CapacityPolicy:
    """The engine's ledger record (registered now, in the scheduler's process): every commit
    is admitted under its live limit (``ELASTICKV_BUDGET`` at start) and the device budget."""
    from elastickv.integrations.vllm.registration import register_engine

    return register_engine(config).policy


def local_policy(config: ElasticConfig) -> CapacityPolicy:
    """Without the ledger: a local byte budget when one is set (a percentage is of this
    host's physical memory, there being no device budget), else unlimited (counted)."""
    if config.budget_bytes is not None:
        return FixedBudget(config.budget_bytes)
    if config.budget_percent is not None:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return FixedBudget(int(physical * config.budget_percent / 100))
    return Unlimited()


@dataclass(frozen=True)
class ElasticStore:
    """The storage of one engine's KV cache (immutable; the range's pages are its state)."""

    config: ElasticConfig
    geometry: KVCacheGeometry
    vmm_range: VirtualRange
    policy: CapacityPolicy
    size_bytes: int

    @classmethod
    def create(
        cls,
        config: ElasticConfig,
        geometry: KVCacheGeometry,
        size_bytes: int,
        policy_factory: PolicyFactory = default_policy,
    ) -> ElasticStore:
        """Reserve ``size_bytes`` (rounded up to pages) with nothing committed."""
        if geometry.backing_bytes > size_bytes:
            raise ElasticKVStartupError(
                f"the KV tensor ({size_bytes} bytes) is smaller than its geometry needs "
                f"({geometry.backing_bytes})"
            )
        backend = HostBackend(config.page_size, strict=config.strict)
        vmm_range = backend.reserve(size_bytes)
        return cls(config, geometry, vmm_range, policy_factory(config), size_bytes)

    @classmethod
    def over(
        cls,
        config: ElasticConfig,
        geometry: KVCacheGeometry,
        vmm_range: VirtualRange,
        size_bytes: int,
        policy_factory: PolicyFactory = default_policy,
    ) -> ElasticStore:
        """The scheduler's store over a range another process reserved (multiprocess mode)."""
        if geometry.backing_bytes > vmm_range.size_bytes:
            raise ElasticKVStartupError(
                f"the worker's KV pool ({vmm_range.size_bytes} bytes) is smaller than its "
                f"geometry needs ({geometry.backing_bytes})"
            )
        return cls(config, geometry, vmm_range, policy_factory(config), size_bytes)

    def backing(self) -> torch.Tensor:
        """vLLM's ``torch.zeros(size, int8)``, over the range: fresh memfd pages read as 0."""
        return self.vmm_range.as_tensor().view(torch.int8)[: self.size_bytes]

    def make_allocator(self) -> BlockAllocator:
        """The allocator the scheduler's block pool places blocks with (block 0 = null)."""
        return BlockAllocator(
            self.geometry,
            self.vmm_range,
            self.policy,
            min_hot_pages=self.config.hot_min_pages,
            max_hot_pages=self.config.hot_max_pages,
            reserve_null_block=True,
            background_precommit=self.config.precommit,
        )

    @property
    def ranks(self) -> int:
        """Worker ranks whose pools this store commits together (tensor parallelism)."""
        return len(self.rank_ranges())

    def rank_ranges(self) -> tuple[VirtualRange, ...]:
        """Each rank's own range, rank order (one range without tensor parallelism)."""
        vmm_range = self.vmm_range
        return vmm_range.shards if isinstance(vmm_range, ShardedRange) else (vmm_range,)

    def footprint_bytes(self) -> int:
        """What the kernel holds for the pool (memfd ``st_blocks``, summed over the ranks),
        not our own count."""
        return self.vmm_range.footprint_bytes()


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
