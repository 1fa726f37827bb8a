"""Refuse KV transfers between caches that would read each other's bytes differently (0.32).

vLLM's ``NixlConnector`` copies blocks byte for byte between a prefill and a decode engine.
On the CPU it accepts a remote block size that divides the local one and splits each local
block into byte chunks, which the CPU attention kernel's pages are not made of: prefill block
32 -> decode block 64 decodes wrong tokens without any error. The reading side's
``add_remote_agent`` (run for each remote rank during the handshake, before anything of the
remote is registered) is wrapped to compare the remote agent's metadata with this engine's
cache first and raise :class:`KVTransferMismatch` naming both values. vLLM then fails the
handshake and, with its default ``kv_load_failure_policy="fail"``, every request waiting on
it: an error, never wrong tokens.

The hooks are installed lazily: :func:`install` wraps the connector factory, and the check
(and the read hold of :mod:`~elastickv.integrations.vllm.transfer.kv_read_hold`) are put on the NIXL
classes only once a process creates a NIXL connector (so engines without a KV connector never
import NIXL).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from elastickv.integrations.vllm.hooks import wrap_method
from elastickv.integrations.vllm.transfer import kv_read_hold, nixl_progress

FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"
NIXL_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
NIXL_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"


class KVTransferMismatch(RuntimeError):
    """The two engines of a KV transfer lay out their caches differently."""


def mismatches(local: Any, remote: Any, remote_tp_size: int) -> list[str]:
    """What differs between this NIXL worker (``local``) and a remote agent's metadata.

    Each entry names the setting, this engine's value and the remote engine's value.
    """
    found = []
    local_per_logical = int(getattr(local, "_physical_blocks_per_logical_kv_block", 1))
    remote_per_logical = int(getattr(remote, "physical_blocks_per_logical_kv_block", 1))
    local_block = int(local.block_size) * local_per_logical
    remote_block = int(remote.block_size) * remote_per_logical
    if local_block != remote_block:
        found.append(f"block size: this engine {local_block}, remote engine {remote_block}")
    elif int(local.block_size) != int(remote.block_size):
        found.append(
            f"kernel block size: this engine {local.block_size}, remote engine {remote.block_size}"
        )
    local_layout = getattr(local, "kv_cache_layout", None)
    if local_layout is not None and local_layout != remote.kv_cache_layout:
        found.append(
            f"KV cache layout: this engine {local_layout}, remote engine {remote.kv_cache_layout}"
        )
    local_lens = list(getattr(local, "block_len_per_layer", []))
    same_tp = remote_tp_size == getattr(local, "transfer_tp_size", remote_tp_size)
    if not found and same_tp and local_lens and local_lens != list(remote.block_lens):
        found.append(
            f"bytes per block (head size, heads or dtype): this engine {local_lens[0]}, "
            f"remote engine {remote.block_lens[0]}"
        )
    return found


def check_remote(local: Any, remote: Any, remote_tp_size: int) -> None:
    """Raise :class:`KVTransferMismatch` if ``remote``'s blocks cannot be read as ours."""
    found = mismatches(local, remote, remote_tp_size)
    if not found:
        return
    raise KVTransferMismatch(
        f"elastickv: refusing KV transfers with remote engine {remote.engine_id}: "
        + "; ".join(found)
        + ". A KV connector copies blocks byte for byte, so the other engine's blocks would "
        "be read as garbage (wrong tokens). Start the prefill and the decode engine with the "
        "same --block-size (and the same model, dtype and KV cache layout)."
    )


def _guard_add_remote_agent(original: Callable[..., str]) -> Callable[..., str]:
    def add_remote_agent(
        self: Any,
        nixl_agent_meta: Any,
        remote_tp_rank: int = 0,
        remote_tp_size: int = 1,
        remote_dcp_size: int = 1,
    ) -> str:
        # Raised in vLLM's handshake thread: vLLM logs it with the failed handshake and fails
        # the requests waiting on it.
        check_remote(self, nixl_agent_meta, remote_tp_size)
        return original(self, nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)

    return add_remote_agent


def install_nixl_guard(read_hold_s: float = kv_read_hold.DEFAULT_HOLD_S) -> bool:
    """Wrap the NIXL worker's ``add_remote_agent`` and put the read hold on the NIXL classes
    if their modules are loaded; whether they are."""
    module = sys.modules.get(NIXL_WORKER_MODULE)
    worker = getattr(module, "NixlBaseConnectorWorker", None)
    if worker is None:
        return False
    wrap_method(worker, "add_remote_agent", _guard_add_remote_agent)
    connector = getattr(sys.modules.get(NIXL_CONNECTOR_MODULE), "NixlBaseConnector", None)
    kv_read_hold.install(worker, connector, read_hold_s)
    return True


def _after_create(read_hold_s: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_connector(cls: type, *args: Any, **kwargs: Any) -> Any:
            connector = original(cls, *args, **kwargs)
            install_nixl_guard(read_hold_s)
            return connector

        return create_connector

    return make


def install(
    read_hold_s: float = kv_read_hold.DEFAULT_HOLD_S, nixl_wait_ms: int | None = None
) -> None:
    """Check NIXL handshakes and hold unread blocks in every process that creates a NIXL
    connector, and set its NIXL progress thread's wait (``None``: the platform's default;
    :mod:`~elastickv.integrations.vllm.transfer.nixl_progress`); idempotent."""
    nixl_progress.apply_when_loaded(nixl_wait_ms)
    if install_nixl_guard(read_hold_s):
        return
    module = sys.modules.get(FACTORY_MODULE)
    if module is None:
        import importlib

        try:
            module = importlib.import_module(FACTORY_MODULE)
        except ImportError:  # a vLLM build without KV connectors: nothing to check
            return
    wrap_classmethod(module.KVConnectorFactory, "create_connector", _after_create(read_hold_s))


def wrap_classmethod(
    owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """:func:`wrap_method` for a classmethod: ``make`` gets and returns ``(cls, ...)``."""
    descriptor = owner.__dict__[name]
    if not isinstance(descriptor, classmethod):
        raise TypeError(f"{owner.__name__}.{name} is not a classmethod")
    holder = type("_Holder", (), {name: descriptor.__func__})
    wrap_method(holder, name, make)
    setattr(owner, name, classmethod(holder.__dict__[name]))
