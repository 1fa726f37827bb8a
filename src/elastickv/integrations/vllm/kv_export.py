"""What a worker tells the engine core about its KV cache, over ``collective_rpc``.

Each worker places its own KV cache (:mod:`.worker_kv`); the engine core, whose scheduler
grants the pages, needs each worker's geometry, pool size, page size and ledger device to
build its :class:`~elastickv.vmm.grants.PageGrants` and register the engine. Plain values
only, so no pickled callables travel (``VLLM_ALLOW_INSECURE_SERIALIZATION`` is not needed).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from elastickv.geometry import KVCacheGeometry
from elastickv.integrations.vllm.errors import ElasticKVStartupError

# The worker methods the engine core calls; plain names, so no pickled callables travel.
EXPORT_METHOD = "elastickv_export_kv_pool"
APPLY_METHOD = "elastickv_apply_page_ops"
# The attribute of a step's ``SchedulerOutput`` that carries its page operations to every
# worker (a :class:`~elastickv.vmm.grants.PageOps` or None; every executor pickles the
# object whole, or passes it as is).
PAGE_OPS_ATTR = "elastickv_page_ops"
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
class KVExport:
    """One worker's KV cache as the engine core needs it; plain values only.

    ``device`` is the ledger the pages are charged to (``host``, or ``cuda-<UUID>`` of the
    worker's GPU). ``pid`` and ``fd`` say where the pool is for tools that read its
    footprint from the kernel (``-1``: no file, e.g. device memory); no engine process opens
    another's memory."""

    pid: int
    fd: int
    size_bytes: int
    page_size: int
    device: str
    geometry: dict[str, WireValue]

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: Any) -> KVExport:
        if not isinstance(wire, dict) or set(wire) != {f.name for f in dataclasses.fields(cls)}:
            raise ElasticKVStartupError(
                f"the worker's elastickv export is malformed ({wire!r}); are the engine core "
                "and its workers running the same elastickv?"
            )
        return cls(**wire)
