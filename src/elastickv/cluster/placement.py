"""Which replica a model's request goes to: the rule of the cluster's request router, with no
Ray in it (``routing`` applies it inside Ray Serve's router).

Ray Serve's multiplexing learns which replica holds which model from the replicas themselves,
a push that reaches the router a moment after a load began. A router that only had that would
send two quick requests for a new model to two replicas (each then starting an engine), or
count a replica as empty while it loads. So the router also remembers where it placed each
model itself (``placed``), the moment it chose; a replica that drops the model (its least
recently used, when full) or dies is forgotten.

The rule, for a model wanted on ``copies`` replicas (1, or more for a hot model):

* held by at least ``copies`` replicas (or by every live one): those replicas only (the least
  busy of them takes it);
* else a new copy: the replica holding the fewest models among those without it, the one on
  the router's own node first on a tie; if it is busy, the holders, never another replica.
  A new copy goes only where the rule chose: Ray Serve moves to the next rank when no
  replica of a rank answers its queue probe in time, and a rank of "any other" replica made a
  second copy (a second engine start) whenever the chosen one answered late on a loaded
  machine. The request waits for the chosen replica instead (one that is gone leaves the
  candidates, and the rule chooses again).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaView:
    """A live replica as the router sees it."""

    replica_id: str
    node_id: str
    models: frozenset[str]  # what the replica last said it holds or is loading


def known_models(replica: ReplicaView, placed: Mapping[str, set[str]]) -> set[str]:
    """What ``replica`` holds as far as the router knows: what it said, and what was placed."""
    return set(replica.models) | {m for m, where in placed.items() if replica.replica_id in where}


def rank(
    model: str,
    replicas: Sequence[ReplicaView],
    placed: Mapping[str, set[str]],
    copies: int,
    local_node: str | None,
) -> tuple[list[list[str]], str | None]:
    """Ranks of replica ids (most preferred first; empty ranks left out) for a request for
    ``model``, and the replica a new copy goes to (None when enough replicas hold it)."""
    if not replicas:
        return [], None
    holders = [r for r in replicas if model in known_models(r, placed)]
    others = [r for r in replicas if r not in holders]
    if len(holders) >= copies or not others:  # enough copies, or every live replica has one
        return [[r.replica_id for r in holders]], None
    load = {r.replica_id: len(known_models(r, placed)) for r in others}

    def preference(r: ReplicaView) -> tuple[int, int, str]:
        return (load[r.replica_id], 0 if r.node_id == local_node else 1, r.replica_id)

    chosen = min(others, key=preference)
    ranks = [[chosen.replica_id], [r.replica_id for r in holders]]
    return [group for group in ranks if group], chosen.replica_id


def forget(
    placed: dict[str, set[str]],
    replicas: Sequence[ReplicaView],
    before: Mapping[str, frozenset[str]],
) -> None:
    """Drop from ``placed`` the replicas that are gone, and each model a replica said it
    held before (``before``: replica id -> models) and no longer does (it dropped it)."""
    live = {r.replica_id: r for r in replicas}
    for model, where in placed.items():
        for replica_id in list(where):
            replica = live.get(replica_id)
            said_before = model in before.get(replica_id, frozenset())
            if replica is None or (said_before and model not in replica.models):
                where.discard(replica_id)
    for model in [m for m, where in placed.items() if not where]:
        del placed[model]
