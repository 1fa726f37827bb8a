"""What an elastic engine says about itself: its start-up line, why it could not start, and
(rate-limited) when its limit makes vLLM wait.

Why a module of its own: these lines are what a vLLM user reads to know elastickv is on and
why an engine waits or refuses; they are assembled from the store, the allocator and the
ledger, none of which should know about log wording.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastickv import __version__
from elastickv.alloc import PageMap, null_floor_bytes
from elastickv.integrations.vllm.engine.floor import needs_at_least
from elastickv.units import format_bytes, format_size

if TYPE_CHECKING:
    from elastickv.alloc import BlockAllocator
    from elastickv.integrations.vllm.engine.registration import EngineRegistration
    from elastickv.integrations.vllm.scheduler.store import ElasticStore

logger = logging.getLogger(__name__)
REFUSAL_LOG_INTERVAL_S = 10.0


def log_startup(
    store: ElasticStore, allocator: BlockAllocator, registration: EngineRegistration | None
) -> None:
    """One INFO line in vLLM's log: elastickv is on, and with what."""
    from elastickv.integrations.vllm.contract import installed_version

    geometry = store.geometry
    where = (
        f"instance {registration.name!r} in ledger {registration.ledger.path}"
        if registration is not None
        else "no ledger"
    )
    if store.ranks > 1:
        where += f", every page granted to its {store.ranks} tensor-parallel ranks"
    logger.info(
        "elastickv %s on vLLM %s (%s contract): %s; %d KV blocks in a virtual %s, pages of "
        "%s committed on demand (floor %s), budget %s",
        __version__,
        installed_version(),
        getattr(geometry.contract, "value", geometry.contract),
        where,
        geometry.num_blocks,
        format_bytes(store.vmm_range.size_bytes),
        format_bytes(allocator.page_size),
        format_bytes(allocator.floor_bytes()),
        store.config.budget_text(),
    )


def startup_refusal(store: ElasticStore, registration: EngineRegistration | None) -> str:
    """Why the null block's pages (the first commit) were refused, with the minimum in the
    user's units and what to change."""
    config = store.config
    per_page = store.vmm_range.bytes_per_page
    floor = null_floor_bytes(PageMap(store.geometry, config.page_size), per_page)
    pages = floor // per_page
    on_ranks = f" on each of its {store.ranks} ranks" if store.ranks > 1 else ""
    need = (
        f"{needs_at_least(floor)}: its null block's "
        f"{pages} page{'s' if pages != 1 else ''} of {format_bytes(config.page_size)}"
        f"{on_ranks}, held while it runs"
    )
    smaller_pages = (
        f", or a smaller ELASTICKV_PAGE_SIZE (the minimum is {pages} pages)" if pages > 1 else ""
    )
    budget = (
        config.shown("budget_bytes", f"{config.budget_percent:g}%")
        if config.budget_percent is not None
        else config.shown("budget_bytes", config.budget_bytes)
        if config.budget_bytes is not None
        else None
    )
    if registration is None:
        return (
            f"cannot commit the KV cache's null block: {budget or 'the capacity policy'} "
            f"refused it; {need}. Raise ELASTICKV_BUDGET{smaller_pages}"
        )
    info = registration.handle.info()
    if info.limit_desired is not None and info.limit_desired < floor:
        return (
            f"{budget or 'the instance limit'} is below the minimum: {need}. Set "
            f"ELASTICKV_BUDGET to at least {format_size(floor)}{smaller_pages}"
        )
    usage = registration.ledger.device_usage()
    others = [
        f"{i.name} {format_bytes(i.used_bytes)}"
        for i in registration.ledger.list_instances()
        if i.name != registration.name
    ]
    return (
        f"the device budget is full: ledger {usage.path} has {format_bytes(usage.available_bytes)} "
        f"free of {format_bytes(usage.budget_bytes)} (in use: {', '.join(others) or 'nothing'}); "
        f"{need}. Stop another engine or lower its limit (`elastickv limit NAME SIZE`)"
    )


class RefusalLog:
    """Counts allocations the limit refused; logs the first, then at most one line per
    interval (a refusal happens on every scheduler step while an engine is at its limit, so
    a caller may hold refusals back while ``time.monotonic() < next_log`` and pass their
    ``count`` with the next one)."""

    def __init__(self, name: str, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.name = name
        self.interval_s = interval_s
        self.count = 0
        self._pending = 0
        self.next_log = 0.0  # no line before this (monotonic clock)

    def refused(self, blocks: int, committed_bytes: Callable[[], int], count: int = 1) -> None:
        """``count`` refusals, the last of ``blocks``; ``committed_bytes`` is read only when a
        line is logged."""
        self.count += count
        self._pending += count
        now = time.monotonic()
        if now < self.next_log:
            return
        self.next_log = now + self.interval_s
        logger.info(
            "elastickv: %r is at its memory limit (%s committed): %d allocation%s refused "
            "(last: %d blocks); vLLM keeps requests waiting or preempts until memory frees",
            self.name,
            format_bytes(committed_bytes()),
            self._pending,
            "s" if self._pending != 1 else "",
            blocks,
        )
        self._pending = 0
