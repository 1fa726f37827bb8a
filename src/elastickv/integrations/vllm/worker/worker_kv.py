"""A worker's own KV storage: the range it reserves, and the pages the scheduler grants it.

Every worker rank places its KV cache on a range of its own, in its own process, on its own
device (host memory here); nothing is shared with the engine core. The scheduler grants
pages and each step carries the page operations to every worker, which maps them before the
step's forward (:class:`~elastickv.vmm.grants.GrantFollower`). So the same protocol serves
one process (vLLM's ``uni`` executor), several processes (``mp``), and Ray workers on other
hosts, and a strict range faults on a stray access in the worker itself.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.kv_export import KVExport, geometry_to_wire
from elastickv.vmm import HostBackend, HostRange, VirtualRange, VmmError
from elastickv.vmm.grants import GrantFollower, PageOps

logger = logging.getLogger(__name__)
HOST_DEVICE = "host"


class PageMapError(RuntimeError):
    """A worker could not map pages the scheduler granted: the engine cannot go on."""


@dataclass(frozen=True)
class WorkerKV:
    """One worker's KV storage: its range, the follower that maps what the scheduler grants,
    and the ledger device its pages are charged to."""

    geometry: KVCacheGeometry
    vmm_range: VirtualRange
    follower: GrantFollower
    size_bytes: int
    device: str

    @classmethod
    def create(
        cls, config: ElasticConfig, geometry: KVCacheGeometry, size_bytes: int, device: torch.device
    ) -> WorkerKV:
        """Reserve ``size_bytes`` (rounded up to pages) on ``device``, nothing committed."""
        if geometry.backing_bytes > size_bytes:
            raise ElasticKVStartupError(
                f"the KV tensor ({size_bytes} bytes) is smaller than its geometry needs "
                f"({geometry.backing_bytes})"
            )
        if device.type != "cpu":
            raise ElasticKVStartupError(
                f"elastickv cannot place a KV cache on {device} (the host backend serves "
                "vLLM's CPU platform)"
            )
        backend = HostBackend(config.page_size, strict=config.strict)
        vmm_range = backend.reserve(size_bytes)
        try:
            # vLLM's null block (block 0) is read by dummy runs and padded batches before
            # the scheduler's first grant arrives; the scheduler holds its pages for the
            # engine's life too (its floor), so both sides agree from the start.
            vmm_range.commit(geometry.block_pages(0, config.page_size))
        except VmmError as exc:
            vmm_range.close()
            raise ElasticKVStartupError(
                f"this worker (pid {os.getpid()}) cannot commit its KV cache's null block: {exc}"
            ) from exc
        except BaseException:
            vmm_range.close()
            raise
        return cls(geometry, vmm_range, GrantFollower(vmm_range), size_bytes, HOST_DEVICE)

    def backing(self) -> torch.Tensor:
        """vLLM's ``torch.zeros(size, int8)``, over the range: pages read as zeros once mapped
        and are mapped before a forward writes them."""
        return self.vmm_range.as_tensor().view(torch.int8)[: self.size_bytes]

    @property
    def fd(self) -> int:
        """The memfd behind a host range (-1 for device memory)."""
        vmm_range = self.vmm_range
        return vmm_range.pool.fd if isinstance(vmm_range, HostRange) else -1

    def export(self) -> KVExport:
        return KVExport(
            pid=os.getpid(),
            fd=self.fd,
            size_bytes=self.size_bytes,
            page_size=self.vmm_range.page_size,
            device=self.device,
            geometry=geometry_to_wire(self.geometry),
        )

    def apply(self, ops: PageOps | None) -> None:
        """Map and release what the scheduler granted for the step about to run; a failure is
        :class:`PageMapError` (the step must not run on an unmapped block)."""
        try:
            self.follower.apply(ops)
        except VmmError as exc:
            raise PageMapError(
                f"this worker (pid {os.getpid()}) cannot map the KV pages the scheduler granted "
                f"for the next step: {exc}. Memory was taken outside the elastickv ledger, or "
                "the device failed; the engine stops rather than run on unmapped blocks"
            ) from exc

    def settle(self) -> None:
        """The engine is idle: wait for queued work and release every page still held."""
        try:
            self.follower.settle()
        except VmmError as exc:
            raise PageMapError(
                f"this worker (pid {os.getpid()}) cannot release KV pages: {exc}"
            ) from exc

    def footprint_bytes(self) -> int:
        """What the kernel or driver holds for this worker's pool."""
        return self.vmm_range.footprint_bytes()
