"""The cluster's request router: Ray Serve's router for a pool's replicas, placing each model
by the rule of :mod:`elastickv.cluster.placement`.

Ray Serve creates one in every process that holds a handle to the pool (the ingress), from
the pool's ``request_router_config``; ``request_router_kwargs`` carries each model's number of
copies. The rule needs what Ray Serve's own multiplexing router keeps (which replica said it
holds which model) and what only this router knows (where it placed a model a moment ago).
"""

from __future__ import annotations

from typing import Any

import ray
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from elastickv.cluster.placement import ReplicaView, forget, rank


class PlacementRouter(RequestRouter):  # type: ignore[misc]
    """Ray Serve ``RequestRouter``: multiplexed requests by :func:`placement.rank`."""

    def initialize_state(self, copies: dict[str, int] | None = None, **_: Any) -> None:
        self._copies = dict(copies or {})
        self._placed: dict[str, set[str]] = {}
        self._said: dict[str, frozenset[str]] = {}  # replica id -> models it last reported
        try:
            self._node: str | None = ray.get_runtime_context().get_node_id()
        except Exception:  # not in a Ray worker or driver: no node preference
            self._node = None

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        views = [_view(r) for r in replicas]
        forget(self._placed, views, self._said)
        self._said = {v.replica_id: v.models for v in views}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        model = None if pending_request is None else pending_request.metadata.multiplexed_model_id
        if pending_request is not None:  # back off between tries while all are busy
            pending_request.routing_context.should_backoff = True
        if not model:  # not a model request (none are sent): any replica
            return [list(candidate_replicas)]
        views = [_view(r) for r in candidate_replicas]
        ranks, new_copy = rank(model, views, self._placed, self._copies.get(model, 1), self._node)
        if new_copy is not None:
            self._placed.setdefault(model, set()).add(new_copy)
        return [[by_id[i] for i in group] for group in ranks]


def _view(replica: RunningReplica) -> ReplicaView:
    return ReplicaView(
        replica.replica_id.unique_id, replica.node_id, frozenset(replica.multiplexed_model_ids)
    )
