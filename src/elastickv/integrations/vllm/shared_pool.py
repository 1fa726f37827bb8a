"""Elastic KV storage when vLLM's scheduler and its worker are different processes.

In vLLM's default multiprocess mode the worker (which owns the KV tensor) and the engine
core (whose scheduler hands out blocks) do not share memory. The worker therefore creates
the physical pool (a memfd) and maps *all* of it ``MAP_SHARED``; the engine core asks the
worker for a :class:`PoolExport` over ``collective_rpc`` (a method name: no insecure
serialisation) and opens the same memfd through ``/proc/<pid>/fd/<n>``. The scheduler then
commits (``fallocate``) and releases (punch hole) the pages the worker writes.

What this costs: strict faulting only protects the scheduler's own mapping, not the
worker's (its mapping is plain read-write). What it keeps: the footprint is still exact,
because it is the memfd's allocated blocks, whoever maps them, and a punched page is
unmapped from every process that maps it.
"""

from __future__ import annotations

import dataclasses
import enum
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError
from elastickv.vmm import HostBackend, HostRange
from elastickv.vmm.base import round_up
from elastickv.vmm.host import HostPool

# The worker method the engine core calls; a plain name, so no pickled callables travel.
EXPORT_METHOD = "elastickv_export_kv_pool"
IN_PROCESS = "in-process"
SHARED = "shared"
WireValue = int | str | None


def geometry_to_wire(geometry: KVCacheGeometry) -> dict[str, WireValue]:
    """The geometry's constructor arguments as plain values (enums by name or value)."""
    wire: dict[str, WireValue] = {}
    for item in dataclasses.fields(geometry):
        if not item.init:
            continue
        value = getattr(geometry, item.name)
        if isinstance(value, enum.Enum):
            value = value.name if item.name == "layout" else value.value
        wire[item.name] = value
    return wire


def geometry_from_wire(wire: dict[str, Any]) -> KVCacheGeometry:
    return KVCacheGeometry(**wire)


@dataclass(frozen=True)
class PoolExport:
    """What the engine core needs to drive the worker's pool; plain values only."""

    pid: int
    fd: int
    size_bytes: int
    page_size: int
    mapping: str  # IN_PROCESS (one shared strict range) or SHARED (worker maps it all)
    geometry: dict[str, WireValue]

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: Any) -> PoolExport:
        if not isinstance(wire, dict) or set(wire) != {f.name for f in dataclasses.fields(cls)}:
            raise ElasticKVStartupError(
                f"the worker's elastickv export is malformed ({wire!r}); are the engine core "
                "and its workers running the same elastickv?"
            )
        return cls(**wire)

    @property
    def proc_path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


@dataclass(frozen=True)
class WorkerPool:
    """The worker's side in multiprocess mode: the memfd and one read-write shared mapping."""

    pool: HostPool
    mapping: mmap.mmap
    size_bytes: int

    @classmethod
    def create(cls, config: ElasticConfig, size_bytes: int) -> WorkerPool:
        pool = HostPool.create(round_up(size_bytes, config.page_size), page_size=config.page_size)
        try:
            mapping = mmap.mmap(
                pool.fd,
                pool.size_bytes,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as exc:
            pool.close()
            raise ElasticKVStartupError(f"cannot map the KV pool in the worker: {exc}") from exc
        return cls(pool, mapping, size_bytes)

    def backing(self) -> torch.Tensor:
        """vLLM's ``torch.zeros(size, int8)``: holes read as zeros and are committed by the
        scheduler before a forward writes them."""
        return torch.frombuffer(self.mapping, dtype=torch.int8)[: self.size_bytes]

    def export(self, geometry: KVCacheGeometry) -> PoolExport:
        return PoolExport(
            pid=os.getpid(),
            fd=self.pool.fd,
            size_bytes=self.size_bytes,
            page_size=self.pool.page_size,
            mapping=SHARED,
            geometry=geometry_to_wire(geometry),
        )

    def footprint_bytes(self) -> int:
        return self.pool.footprint_bytes()


def open_exported(config: ElasticConfig, export: PoolExport) -> HostRange:
    """The engine core's strict range over the worker's pool (a :class:`HostRange`)."""
    if export.mapping != SHARED:
        raise ElasticKVStartupError(
            f"the worker (pid {export.pid}) placed the KV cache on a process-private range "
            f"({export.mapping}) but the scheduler runs in pid {os.getpid()}; elastickv cannot "
            "commit its pages from here"
        )
    if export.page_size != config.page_size:
        raise ElasticKVStartupError(
            f"the worker uses {export.page_size}-byte pages but the engine core "
            f"{config.page_size}; every vLLM process must see the same ELASTICKV_PAGE_SIZE"
        )
    backend = HostBackend(config.page_size, strict=config.strict)
    try:
        return backend.open(export.proc_path)
    except Exception as exc:
        raise ElasticKVStartupError(
            f"cannot open the worker's KV pool {export.proc_path}: {exc}"
        ) from exc
