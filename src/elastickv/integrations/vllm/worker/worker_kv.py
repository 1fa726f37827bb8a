"""A worker's own KV storage: the range it reserves, and the pages the scheduler grants it.

Every worker rank places its KV cache on a range of its own, in its own process, on its own
device: host memory (vLLM's CPU platform) or its GPU's memory through the CUDA driver's
virtual memory API. Nothing is shared with the engine core. The scheduler grants pages and
each step carries the page operations to every worker, which maps them before the step's
forward (:class:`~elastickv.vmm.grants.GrantFollower`). So the same protocol serves one
process (vLLM's ``uni`` executor), several processes (``mp``), and Ray workers on other
hosts, and a stray access faults (or reads zeros) in the worker itself.

On a GPU the worker queues steps ahead of the device (vLLM's asynchronous scheduling): a page
the scheduler released may still be read by a step already queued, so its release waits for
a CUDA event recorded after that step's work (:class:`CudaFence`).

Steps vLLM runs without its scheduler (Model Runner V2's kernel warm-up writes KV into blocks
1..K) carry no grants: the worker maps the pages of their blocks itself and releases them
before the first step the scheduler planned (:meth:`WorkerKV.map_unplanned`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.integrations.vllm.kv_export import KVExport, geometry_to_wire
from elastickv.vmm import HostBackend, HostRange, VirtualRange, VmmBackend, VmmError
from elastickv.vmm.grants import GrantFollower, PageOps

logger = logging.getLogger(__name__)
HOST_DEVICE = "host"
# How often (in steps) a GPU worker checks that no kernel wrote to the shared zero page under
# its uncommitted pages (where the driver could not make that page read-only).
ZERO_PAGE_CHECK_STEPS = 256


class PageMapError(RuntimeError):
    """A worker could not map pages the scheduler granted: the engine cannot go on."""


class Fence(Protocol):
    """How a worker knows queued device work is done: a token per step, whether a token's
    work is done, and a wait for all of it."""

    def mark(self) -> object: ...

    def done(self, token: object) -> bool: ...

    def wait(self) -> None: ...


class CudaFence:
    """Events on the worker's compute stream: a step's queued work is done when its event
    is (the release of a page that step may read waits for it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> object:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def done(self, token: object) -> bool:
        assert isinstance(token, torch.cuda.Event)
        return bool(token.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        torch.cuda.synchronize(self.device)


def backend_for(
    config: ElasticConfig, device: torch.device
) -> tuple[VmmBackend, str, Fence | None]:
    """The VMM backend for a KV cache on ``device``, the ledger it is charged to, and the
    fence its releases wait for: host memory for vLLM's CPU platform (strict unless
    ``ELASTICKV_STRICT=0``; a step's forward returned before the next starts: no fence), the
    CUDA driver's VMM on a GPU (uncommitted pages on a shared zero page unless
    ``ELASTICKV_STRICT=1``: there a fault kills the engine's whole CUDA context; zeroing and
    waits on the compute stream; CUDA events as the fence)."""
    if device.type == "cpu":
        strict = True if config.strict is None else config.strict
        return HostBackend(config.page_size, strict=strict), HOST_DEVICE, None
    if device.type == "cuda":
        from elastickv.control import cuda_device_key
        from elastickv.vmm.cuda import CudaBackend

        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(device).cuda_stream
        backend = CudaBackend(
            index,
            config.page_size,
            uncommitted="fault" if config.strict else "zero",
            sync_stream=int(stream),
        )
        return backend, cuda_device_key(backend.driver.uuid()), CudaFence(device)
    raise ElasticKVStartupError(
        f"elastickv cannot place a KV cache on {device}: it places it in host memory (vLLM's "
        "CPU platform) or in an NVIDIA GPU's memory (vLLM's CUDA platform)"
    )


@dataclass
class WorkerKV:
    """One worker's KV storage: its range, the follower that maps what the scheduler grants,
    and the ledger device its pages are charged to."""

    geometry: KVCacheGeometry
    vmm_range: VirtualRange
    follower: GrantFollower
    size_bytes: int
    device: str
    null_pages: frozenset[int]
    # Pages mapped for steps vLLM ran without its scheduler (warm-up), until the first step
    # the scheduler planned.
    unplanned: set[int] = field(default_factory=set)
    steps: int = 0

    @classmethod
    def create(
        cls, config: ElasticConfig, geometry: KVCacheGeometry, size_bytes: int, device: torch.device
    ) -> WorkerKV:
        """Reserve ``size_bytes`` (rounded up to pages) on ``device``, with only the null
        block's pages committed."""
        if geometry.backing_bytes > size_bytes:
            raise ElasticKVStartupError(
                f"the KV tensor ({size_bytes} bytes) is smaller than its geometry needs "
                f"({geometry.backing_bytes})"
            )
        backend, ledger_device, fence = backend_for(config, device)
        return cls.over(geometry, backend.reserve(size_bytes), size_bytes, ledger_device, fence)

    @classmethod
    def over(
        cls,
        geometry: KVCacheGeometry,
        vmm_range: VirtualRange,
        size_bytes: int,
        ledger_device: str,
        fence: Fence | None = None,
    ) -> WorkerKV:
        """The worker's storage on a range it reserved (closed again if this fails): the
        null block's pages committed, a follower fenced by ``fence`` (None: releases at
        once)."""
        null_pages = frozenset(geometry.block_pages(0, vmm_range.page_size))
        try:
            # vLLM's null block (block 0) is read by dummy runs and padded batches before
            # the scheduler's first grant arrives; the scheduler holds its pages for the
            # engine's life too (its floor), so both sides agree from the start.
            vmm_range.commit(null_pages)
        except VmmError as exc:
            vmm_range.close()
            raise ElasticKVStartupError(
                f"this worker (pid {os.getpid()}) cannot commit its KV cache's null block: {exc}"
            ) from exc
        except BaseException:
            vmm_range.close()
            raise
        if fence is not None:
            follower = GrantFollower(
                vmm_range, mark_step=fence.mark, done=fence.done, wait=fence.wait
            )
        else:
            follower = GrantFollower(vmm_range)
        return cls(geometry, vmm_range, follower, size_bytes, ledger_device, null_pages)

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
        """Map and release what the scheduler granted for the step about to run (the first
        planned step also ends any warm-up mapping); a failure is :class:`PageMapError`: the
        step must not run on an unmapped block."""
        try:
            if self.unplanned:
                self._end_unplanned()
            self.follower.apply(ops)
            self.steps += 1
            if self.steps % ZERO_PAGE_CHECK_STEPS == 0:
                self._check_zero_page()
        except VmmError as exc:
            raise PageMapError(
                f"this worker (pid {os.getpid()}) cannot map the KV pages the scheduler granted "
                f"for the next step: {exc}. Memory was taken outside the elastickv ledger, or "
                "the device failed; the engine stops rather than run on unmapped blocks"
            ) from exc

    def map_unplanned(self, block_ids: Iterable[int]) -> None:
        """A step vLLM runs without its scheduler (a warm-up) will write ``block_ids``: map
        their pages here, until the first step the scheduler planned."""
        page_size = self.vmm_range.page_size
        pages: set[int] = set()
        for block in block_ids:
            pages.update(self.geometry.block_pages(block, page_size))
        pages -= self.vmm_range.committed_pages()
        if pages:
            try:
                self.vmm_range.commit(pages)
            except VmmError as exc:
                raise PageMapError(
                    f"this worker (pid {os.getpid()}) cannot map the KV pages of vLLM's "
                    f"warm-up: {exc}"
                ) from exc
            self.unplanned.update(pages)

    def _end_unplanned(self) -> None:
        """Release the warm-up's pages once its work is done (the scheduler never granted
        them: it would never release them)."""
        self.follower.wait()
        pages, self.unplanned = self.unplanned, set()
        self.vmm_range.release(pages - self.null_pages)
        logger.debug("elastickv: released %d page(s) vLLM's warm-up used", len(pages))

    def _check_zero_page(self) -> None:
        check = getattr(self.vmm_range, "check_zero_page", None)
        if check is not None and check():
            logger.error(
                "elastickv: a kernel wrote to an uncommitted KV page (the shared zero page was "
                "found written and zeroed again); some block was used before it was granted. "
                "Run with ELASTICKV_STRICT=1 and CUDA_LAUNCH_BLOCKING=1 to find the kernel"
            )

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


def scheduled_block_ids(scheduler_output: Any) -> set[int]:
    """Every block id a ``SchedulerOutput`` hands the worker (new requests' blocks, running
    requests' new blocks), in every KV cache group."""
    found: set[int] = set()
    for request in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
        for group in getattr(request, "block_ids", ()) or ():
            found.update(group)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    for groups in getattr(cached, "new_block_ids", ()) or ():
        for group in groups or ():
            found.update(group)
    return found
