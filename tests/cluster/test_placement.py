"""The cluster's routing rule (:mod:`elastickv.cluster.placement`), without Ray: a model goes
to the replicas that hold it, a new copy to the replica with the fewest models (the router's
own node first on a tie), never to more replicas than its copies; what the router placed
itself counts at once, and is forgotten with a replica that dies or drops the model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.cluster.placement import ReplicaView, forget, known_models, rank

MODELS = ["a", "b", "c", "d", "e"]


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[ReplicaView], dict[str, set[str]], str, int, str]:
    count = draw(st.integers(1, 5))
    nodes = [f"n{i}" for i in range(draw(st.integers(1, count)))]
    replicas = [
        ReplicaView(
            f"r{i}", draw(st.sampled_from(nodes)),
            frozenset(draw(st.lists(st.sampled_from(MODELS), max_size=3))),
        )
        for i in range(count)
    ]  # fmt: skip
    placed: dict[str, set[str]] = {}
    for model in MODELS:
        where = draw(st.sets(st.sampled_from([r.replica_id for r in replicas]), max_size=2))
        if where:
            placed[model] = where
    model = draw(st.sampled_from(MODELS))
    return replicas, placed, model, draw(st.integers(1, 3)), draw(st.sampled_from(nodes))


@settings(max_examples=400, deadline=None)
@given(situations())
def test_the_ranks_follow_the_rule(
    case: tuple[list[ReplicaView], dict[str, set[str]], str, int, str],
) -> None:
    replicas, placed, model, copies, local = case
    ranks, new_copy = rank(model, replicas, placed, copies, local)
    ids = [i for group in ranks for i in group]
    assert len(ids) == len(set(ids)) and set(ids) <= {r.replica_id for r in replicas}
    assert all(ranks)
    holders = {r.replica_id for r in replicas if model in known_models(r, placed)}
    if len(holders) >= min(copies, len(replicas)):
        assert new_copy is None and len(ranks) == 1 and set(ranks[0]) == holders
        return
    assert new_copy is not None and new_copy not in holders and ranks[0] == [new_copy]
    load = {r.replica_id: len(known_models(r, placed)) for r in replicas}
    others = [r for r in replicas if r.replica_id not in holders]
    fewest = min(load[r.replica_id] for r in others)
    assert load[new_copy] == fewest
    if any(r.node_id == local and load[r.replica_id] == fewest for r in others):
        assert next(r for r in replicas if r.replica_id == new_copy).node_id == local
    # Only the holders follow: a busy chosen replica never sends a new copy elsewhere (a rank
    # of every other replica made a second copy whenever the chosen one answered Ray's queue
    # probe late, seen on a loaded machine).
    assert set(ids) == {new_copy} | holders


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.sampled_from(MODELS), st.integers(1, 3)), min_size=1, max_size=30),
)
def test_requests_place_each_model_on_its_copies_and_no_more(
    count: int, requests: list[tuple[str, int]]
) -> None:
    """Requests one after another, each taken by the first replica of its first rank (none
    busy), before any replica has said what it holds: a model ends up on exactly
    min(copies, replicas) replicas, and the models spread (no replica holds two more than
    another right after a new copy was placed by the fewest-models rule)."""
    replicas = [ReplicaView(f"r{i}", f"n{i}", frozenset()) for i in range(count)]
    copies = {m: c for m, c in requests}
    placed: dict[str, set[str]] = {}
    for model, _ in requests:
        ranks, new_copy = rank(model, replicas, placed, copies[model], "n0")
        if new_copy is not None:
            placed.setdefault(model, set()).add(new_copy)
        assert ranks[0][0] in placed[model]
    for model in {m for m, _ in requests}:
        assert len(placed[model]) <= min(copies[model], count)


def test_three_models_over_two_replicas_as_the_cluster_test_places_them() -> None:
    """The ingress's node holds the first model and the third (ties go to the router's own
    node), the other replica the second."""
    head = ReplicaView("h", "head", frozenset())
    worker = ReplicaView("w", "worker", frozenset())
    placed: dict[str, set[str]] = {}
    for model, where in (("a", "h"), ("b", "w"), ("c", "h")):
        ranks, new_copy = rank(model, [head, worker], placed, 1, "head")
        assert new_copy == where and ranks[0] == [where]
        placed.setdefault(model, set()).add(where)
    assert rank("b", [head, worker], placed, 1, "head") == ([["w"]], None)


def test_a_hot_model_gets_its_copies_then_stays_on_them() -> None:
    replicas = [ReplicaView(f"r{i}", "n", frozenset()) for i in range(3)]
    placed: dict[str, set[str]] = {}
    chosen = []
    for _ in range(4):
        ranks, new_copy = rank("hot", replicas, placed, 2, "n")
        if new_copy is not None:
            placed.setdefault("hot", set()).add(new_copy)
            chosen.append(new_copy)
    assert len(chosen) == 2 and placed["hot"] == set(chosen)
    ranks, new_copy = rank("hot", replicas, placed, 2, "n")
    assert new_copy is None and set(ranks[0]) == set(chosen) and len(ranks) == 1


def test_what_a_replica_said_counts_as_placed() -> None:
    """A model a replica reports (loaded by another router, or before this one started)
    is held there: no new copy."""
    replicas = [ReplicaView("r0", "n", frozenset({"a"})), ReplicaView("r1", "n", frozenset())]
    assert rank("a", replicas, {}, 1, "n") == ([["r0"]], None)


def test_dead_replicas_and_dropped_models_are_forgotten() -> None:
    placed = {"a": {"r0", "r1"}, "b": {"r0"}, "c": {"r1"}}
    said = {"r0": frozenset({"a", "b"}), "r1": frozenset({"a"})}
    # r0 died; r1 dropped a (least recently used); c was placed on r1 and not reported yet.
    now = [ReplicaView("r1", "n", frozenset())]
    forget(placed, now, said)
    assert placed == {"c": {"r1"}}
