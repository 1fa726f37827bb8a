"""Control plane: the per-device ledger every elastic instance registers in.

    from elastickv.control import open_ledger, LedgerPolicy

    with open_ledger("host") as ledger, ledger.register("llama-a", limit="30%") as handle:
        allocator = BlockAllocator(geometry, vrange, LedgerPolicy(handle))
        ...
        allocator.close()

Operators (and the CLI) use :func:`list_instances`, :func:`set_limit`, :func:`watch`.
``LedgerPolicy`` is loaded on first use: it needs the allocator (and so torch), which the
operator commands do not.
"""

from typing import TYPE_CHECKING, Any

from elastickv.control.api import (
    device_usage,
    list_instances,
    reset_ledger,
    set_limit,
    snapshot,
    watch,
)
from elastickv.control.errors import (
    RESET_COMMAND,
    DuplicateInstance,
    InstanceClosed,
    LedgerConfigMismatch,
    LedgerCorrupt,
    LedgerError,
    LedgerFull,
    LedgerPermissionError,
    LedgerVersionMismatch,
    LimitBelowFloor,
    StaleRevision,
    UnknownInstance,
)
from elastickv.control.info import DeviceUsage, InstanceInfo, LedgerSnapshot
from elastickv.control.ledger import (
    DEFAULT_UTILIZATION,
    InstanceHandle,
    Ledger,
    LimitSpec,
    host_total_bytes,
    open_ledger,
)
from elastickv.control.limits import parse_limit
from elastickv.control.paths import ENV_DIR, cuda_device_key, ledger_directory, ledger_path

if TYPE_CHECKING:
    from elastickv.control.policy import LedgerPolicy


def __getattr__(name: str) -> Any:
    if name == "LedgerPolicy":
        from elastickv.control.policy import LedgerPolicy

        return LedgerPolicy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_UTILIZATION",
    "ENV_DIR",
    "RESET_COMMAND",
    "DeviceUsage",
    "DuplicateInstance",
    "InstanceClosed",
    "InstanceHandle",
    "InstanceInfo",
    "Ledger",
    "LedgerConfigMismatch",
    "LedgerCorrupt",
    "LedgerError",
    "LedgerFull",
    "LedgerPermissionError",
    "LedgerPolicy",
    "LedgerSnapshot",
    "LedgerVersionMismatch",
    "LimitBelowFloor",
    "LimitSpec",
    "StaleRevision",
    "UnknownInstance",
    "cuda_device_key",
    "device_usage",
    "host_total_bytes",
    "ledger_directory",
    "ledger_path",
    "list_instances",
    "open_ledger",
    "parse_limit",
    "reset_ledger",
    "set_limit",
    "snapshot",
    "watch",
]
