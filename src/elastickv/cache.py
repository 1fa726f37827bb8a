"""One elastic KV cache: geometry + reserved range + ledger registration + allocator + views.

This is the object an engine integration (or a user) creates. Creating it reserves the full
virtual size, registers the instance in the device's ledger (so `elastickv list` shows it and
operators can limit it) and builds the engine-facing views; closing it returns every page and
unregisters. Nothing physical is committed beyond the null block until blocks are allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from types import TracebackType
from typing import Self

import torch

from elastickv.alloc import BlockAllocator
from elastickv.control import InstanceHandle, InstanceInfo, Ledger, LimitSpec, open_ledger
from elastickv.control.policy import LedgerPolicy
from elastickv.geometry import KVCacheGeometry, build_layer_views
from elastickv.vmm import HostBackend, VirtualRange, VmmBackend


class ElasticKVCache:
    """An elastic KV cache registered in its device's ledger.

    ``allocate(n)`` returns ``n`` block ids (their pages committed) or ``None`` for "not now";
    ``free(blocks)`` returns them. ``sync_limit()`` applies a limit an operator lowered: it
    drops the hot reserve at once (live blocks drain as they are freed). It is cheap enough
    to call once per engine step, and ``allocate`` calls it itself before answering "not now".
    """

    def __init__(
        self,
        geometry: KVCacheGeometry,
        *,
        backend: VmmBackend | None = None,
        ledger: Ledger | None = None,
        name: str | None = None,
        limit: LimitSpec = None,
        min_hot_pages: int = 0,
        max_hot_pages: int = 4,
        reserve_null_block: bool = True,
    ) -> None:
        self.geometry = geometry
        self.backend: VmmBackend = backend if backend is not None else HostBackend()
        self._owns_ledger = ledger is None
        self.ledger = ledger if ledger is not None else open_ledger("host")
        cleanup: list[Callable[[], None]] = []
        if self._owns_ledger:
            cleanup.append(self.ledger.close)
        try:
            self.range: VirtualRange = self.backend.reserve(geometry.backing_bytes)
            cleanup.append(self.range.close)
            self.handle: InstanceHandle = self.ledger.register(name, limit=limit)
            cleanup.append(self.handle.close)
            self.policy = LedgerPolicy(self.handle)
            self.allocator = BlockAllocator(
                geometry,
                self.range,
                self.policy,
                min_hot_pages=min_hot_pages,
                max_hot_pages=max_hot_pages,
                reserve_null_block=reserve_null_block,
            )
            cleanup.append(self.allocator.close)
            self.views: list[torch.Tensor] = build_layer_views(geometry, self.range.as_tensor())
        except BaseException:
            for undo in reversed(cleanup):
                undo()
            raise
        self._closed = False

    @property
    def name(self) -> str:
        return self.handle.name

    def info(self) -> InstanceInfo:
        """This instance as the ledger (and ``elastickv list``) sees it."""
        return self.handle.info()

    def allocate(self, n: int) -> list[int] | None:
        blocks = self.allocator.allocate(n)
        if blocks is None:
            self.sync_limit()
        return blocks

    def free(self, blocks: Collection[int]) -> None:
        self.allocator.free(blocks)

    def sync_limit(self) -> int:
        """Release hot-reserve pages while the ledger says this instance is over its limit;
        returns the pages released. Live blocks are never taken back."""
        over = self.handle.info().over_limit_bytes
        if not over:
            return 0
        pages_over = -(-over // self.range.page_size)
        hot = self.allocator.stats().hot_pages
        return self.allocator.trim(max(0, hot - pages_over))

    def footprint_bytes(self) -> int:
        """Physical memory the backend reports for the whole range."""
        return self.range.footprint_bytes()

    def close(self) -> None:
        """Return every page, unregister, release the range. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.allocator.close()
        finally:
            try:
                self.handle.close()
            finally:
                try:
                    self.range.close()
                finally:
                    if self._owns_ledger:
                        self.ledger.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
