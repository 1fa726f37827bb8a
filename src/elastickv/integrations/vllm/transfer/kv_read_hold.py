"""A prefill engine keeps a prompt's blocks until its decoder has read them (0.32, NIXL).

vLLM's prefiller keeps a finished prompt's blocks for the decode engine only for a lease
(``kv_lease_duration``, 30 s by default; the decoder's heartbeats extend it once the decoder
has the request). When the lease runs out first (a router or a queue held the decode request
back), vLLM frees the blocks, and a decoder that reads them afterwards is not told: it
decodes from whatever the blocks hold by then. On elastic storage under a budget that is at
once other prompts' KV or released pages, so the late read gives wrong tokens.

Two hooks close that gap, both in elastic engines only:

- **Prefill side, worker.** A lease that expires before every expected read arrived is held
  ``hold_s`` longer (``ELASTICKV_KV_READ_HOLD``, default 300 s): the blocks stay allocated and
  their pages committed, charged to the engine's budget, until the read's notification frees
  them (vLLM's own path) or the hold ends.
- **Prefill side, scheduler.** The response's ``kv_transfer_params`` carry
  ``elastickv_read_by``, the wall-clock time until which the blocks are surely kept (the
  lease plus the hold).
- **Decode side, scheduler.** A request whose ``elastickv_read_by`` is past, or less than
  ``READ_MARGIN_S`` away, does not read: its prompt is computed locally, which gives the right
  tokens at the cost of a prefill. A decoder without elastickv ignores the key.

The clock is the wall clock of each host: engines on different hosts need synchronised
clocks (NTP keeps them well within the margin).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from elastickv.integrations.vllm.hooks import wrap_method

logger = logging.getLogger(__name__)

READ_BY_KEY = "elastickv_read_by"
# A decoder reads only if the blocks are kept at least this much longer: the time from the
# check to the read's first bytes on a busy engine.
READ_MARGIN_S = 5.0
DEFAULT_LEASE_S = 30.0  # vLLM 0.32's ``kv_lease_duration`` default
DEFAULT_HOLD_S = 300.0
# A lease is held once it ends within this much time: vLLM's reaper reads its own clock after
# the hook has read it, so a lease ending in between would be reaped without the hold. Leases
# set in one step end microseconds apart, and an engine waiting for pages steps in a tight
# loop, so that window is hit (seen: three of five prompts released unheld, their blocks
# reused, the decoder reading other prompts' KV).
HOLD_AHEAD_S = 1.0


class UnreadLeaseHold:
    """The worker-side hold: send leases of unread blocks that run out (or will within
    ``ahead_s``) get ``hold_s`` more."""

    def __init__(self, hold_s: float, ahead_s: float = HOLD_AHEAD_S) -> None:
        if hold_s < 0:
            raise ValueError(f"a read hold must be >= 0 seconds, got {hold_s}")
        if ahead_s < 0:
            raise ValueError(f"a hold's look-ahead must be >= 0 seconds, got {ahead_s}")
        self.hold_s = hold_s
        self.ahead_s = ahead_s
        self._held: set[str] = set()

    def extend(self, leases: dict[str, float], now: float) -> list[str]:
        """Push back, once each, the expiry of every lease in ``leases`` (request id ->
        ``time.perf_counter()`` deadline, vLLM's ``_reqs_to_send``) that has run out or runs
        out within ``ahead_s``; the request ids held now. A request stays in ``leases`` until
        vLLM reports it done (read or reaped), so a request held before is left to expire."""
        held: list[str] = []
        horizon = now + self.ahead_s
        for req_id, expires in leases.items():
            if horizon >= expires and req_id not in self._held:
                self._held.add(req_id)
                leases[req_id] = expires + self.hold_s
                held.append(req_id)
        if len(self._held) > len(leases):
            self._held.intersection_update(leases)
        return held


def read_by(lease_s: float, hold_s: float, now: float | None = None) -> float:
    """The wall-clock time until which a prefiller keeps a finished prompt's blocks."""
    return (time.time() if now is None else now) + lease_s + hold_s


def expired(params: dict[str, Any] | None, now: float | None = None) -> bool:
    """Whether a decode request's ``kv_transfer_params`` say its blocks may be gone by the
    time it would read them (False without the key: a prefiller without elastickv)."""
    if not params or not params.get("do_remote_prefill"):
        return False
    deadline = params.get(READ_BY_KEY)
    if not isinstance(deadline, (int, float)):
        return False
    return (time.time() if now is None else now) > deadline - READ_MARGIN_S


def _hold_on_reap(hold: UnreadLeaseHold) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def make(original: Callable[..., None]) -> Callable[..., None]:
        def _reap_expired_send_leases(self: Any, done_sending: set[str]) -> None:
            leases = getattr(self, "_reqs_to_send", None)
            if leases:
                for req_id in hold.extend(leases, time.perf_counter()):
                    logger.warning(
                        "elastickv: the KV lease of request %s is running out before its "
                        "decoder read the blocks; keeping them %.0f s more for that read "
                        "(ELASTICKV_KV_READ_HOLD)",
                        req_id,
                        hold.hold_s,
                    )
            original(self, done_sending)

        return _reap_expired_send_leases

    return make


def _stamp_read_by(hold_s: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
            delay_free, params = original(self, request, block_ids)
            if delay_free and params and params.get("do_remote_prefill"):
                lease = getattr(self.connector_scheduler, "_kv_lease_duration", DEFAULT_LEASE_S)
                params[READ_BY_KEY] = read_by(float(lease), hold_s)
            return delay_free, params

        return request_finished

    return make


def _recompute_late_reads(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        params = request.kv_transfer_params
        if expired(params):
            logger.warning(
                "elastickv: request %s arrived after the prefill engine's hold on its KV "
                "blocks (remote request %s, %.0f s past the read-by time minus a %.0f s "
                "margin): computing its prompt here instead of reading stale blocks",
                request.request_id,
                params.get("remote_request_id"),
                time.time() - (params[READ_BY_KEY] - READ_MARGIN_S),
                READ_MARGIN_S,
            )
            params["do_remote_prefill"] = False
        return original(self, request, num_computed_tokens)

    return get_num_new_matched_tokens


def install(worker_cls: type | None, connector_cls: type | None, hold_s: float) -> None:
    """Put the hooks on vLLM's NIXL worker and connector classes (idempotent; a class that
    is None is not loaded in this process). ``hold_s`` 0 keeps vLLM's lease as it is and only
    lets decoders recompute reads past it."""
    if worker_cls is not None and hold_s > 0:
        wrap_method(worker_cls, "_reap_expired_send_leases", _hold_on_reap(UnreadLeaseHold(hold_s)))
    if connector_cls is not None:
        for name in ("request_finished", "request_finished_all_groups"):
            wrap_method(connector_cls, name, _stamp_read_by(hold_s))
        wrap_method(connector_cls, "get_num_new_matched_tokens", _recompute_late_reads)
