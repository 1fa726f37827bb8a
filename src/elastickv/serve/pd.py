"""A P/D model: one served name, a prefill engine and a decode engine, and the two-step
exchange the router runs between them.

vLLM's ``NixlConnector`` moves a prompt's KV blocks from the engine that computed them to the
one that continues. The decode engine cannot find them by the prompt alone: the prefill
response's ``kv_transfer_params`` (the prefiller's engine id, block ids, side channel) must go
with the decode request. So the router

1. sends the request to the prefill engine with ``max_tokens`` 1, no stream, and
   ``kv_transfer_params`` asking it to keep the blocks for a remote decoder;
2. sends the original request to the decode engine with the ``kv_transfer_params`` of that
   answer, and passes the decode engine's answer (or stream) to the client.

The pair's engines are two supervised models (``<name>/prefill``, ``<name>/decode``): each has
its own ledger record, limit, idle tiers and restarts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastickv.serve.model import ModelState, ServedModel

# What a prefill request carries: "compute the prompt, keep its blocks for a remote decoder".
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields of a client request that do not apply to the one-token prefill step.
_NOT_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "max_completion_tokens")
# The order in which a pair reports the state of its engines: the first one found wins.
_STATE_ORDER = (
    ModelState.FAILED,
    ModelState.STARTING,
    ModelState.STOPPED,
    ModelState.SERVING,
    ModelState.IDLE,
    ModelState.KV_RELEASED,
)


@dataclass(frozen=True)
class PDPair:
    """A P/D model as the router sees it."""

    name: str
    prefill: ServedModel
    decode: ServedModel

    @property
    def state(self) -> ModelState:
        """One state for both engines: a failed, starting or stopped engine shows first."""
        states = {self.prefill.state, self.decode.state}
        return next(s for s in _STATE_ORDER if s in states)


def prefill_request(payload: dict[str, Any]) -> dict[str, Any]:
    """The first step: the client's request, cut to one token and asking for a transfer."""
    body = {k: v for k, v in payload.items() if k not in _NOT_FOR_PREFILL}
    body["max_tokens"] = 1
    body["kv_transfer_params"] = dict(PREFILL_TRANSFER_PARAMS)
    return body


def decode_request(payload: dict[str, Any], transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The second step: the client's request with the prefill answer's transfer parameters."""
    return {**payload, "kv_transfer_params": transfer_params}


def transfer_params_of(answer: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill answer, or None when it has none."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    return params if isinstance(params, dict) and params else None
