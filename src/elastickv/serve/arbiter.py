"""The memory arbiter: one loop owns the device's shared KV budget B and moves it between
models by demand and priority, through each engine's live ledger limit.

Why limits and not commits: the engines commit pages themselves, admitted by the ledger
under their limit. The arbiter keeps one invariant over the models it serves,

    Σ_i max(limit_i, used_i, min_kv_i) ≤ B,

and since the ledger never lets an engine grow past ``max(limit, what it holds)``, the sum
of committed bytes never exceeds B whatever the interleaving. It lowers limits first (a
shrink is lazy: bytes above the new limit stay until they drain), re-reads the ledger, and
only then raises others into the room that is really free. ``min_kv`` is reserved for every
model at all times, running or not, so waking a model never waits for memory.

Planning (:func:`plan_limits`) is a pure function: floors first, then active models grow by
priority (highest first), equal priorities sharing equally up to what each wants (what it
uses plus a step; its whole cap when the ledger just refused it or it reached its limit);
idle models are held to what they use, and released models to their floor.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from elastickv.control import InstanceInfo, Ledger, StaleRevision, UnknownInstance
from elastickv.control.errors import LedgerError

logger = logging.getLogger(__name__)


class Activity(enum.Enum):
    """What the arbiter needs to know of a model's traffic."""

    ACTIVE = "active"  # requests in flight or waiting
    IDLE = "idle"  # running, nothing in flight: held to what it uses (to min_kv in a squeeze)
    RELEASED = "released"  # tier 1: its KV is released, limit at the engine's floor
    DOWN = "down"  # no engine (stopped, starting, failed): only its min_kv is reserved


@dataclass(frozen=True)
class Demand:
    """One model as the planner sees it."""

    name: str
    min_kv: int
    cap: int
    priority: int
    activity: Activity
    used: int = 0  # committed + reserved in the ledger
    limit: int | None = None  # the limit in force (None: no record yet)
    pressured: bool = False  # refused since the last look, or close to its limit
    floor: int = 0  # the engine's own floor (its null block's pages), for RELEASED

    def want(self, step: int) -> int:
        """What this model should be allowed now, before competition."""
        if self.activity is Activity.RELEASED:
            return max(self.floor, 1)
        if self.activity is Activity.DOWN:
            return self.min_kv
        if self.activity is Activity.IDLE:
            return min(self.cap, max(self.min_kv, self.used))
        if self.pressured:  # refused or at its limit: a burst, give it all it may take
            return self.cap
        return min(self.cap, max(self.min_kv, self.used + step, self.limit or 0))


def plan_limits(demands: Sequence[Demand], budget: int, step: int) -> dict[str, int]:
    """Target limits (bytes) for every model with an engine; DOWN models get none.

    Guarantees (property-tested): ``Σ max(target_i, min_kv_i, used_i) ≤ budget`` whenever
    ``Σ max(min_kv_i, used_i) ≤ budget``; each target is at most the model's cap (or what it
    already holds); a RELEASED model's target is its floor; an IDLE model's is what it holds
    (at least ``min_kv``), or just its ``min_kv`` while an active model is pressured or the
    models' holdings leave no room for every ``min_kv``: what an idle engine holds beyond that
    is prefix cache and hot pages, which it gives back at once when its limit drops, and the
    next look hands that room to the burst or the newcomer (the bytes still count as used
    until they are really released). Active models come first in the result,
    highest priority first: the order in which raises are applied."""
    base = {d.name: max(d.min_kv, d.used) for d in demands}
    # A squeeze: a busy model is pressured, or what the models hold does not leave every
    # model its min_kv (a model just added reserves its min_kv before its engine starts).
    squeeze = any(d.activity is Activity.ACTIVE and d.pressured for d in demands)
    squeeze = squeeze or sum(base.values()) > budget
    targets: dict[str, int] = {}
    for d in demands:
        if d.activity is Activity.RELEASED:
            targets[d.name] = max(1, d.floor)
        elif d.activity is Activity.IDLE:
            targets[d.name] = d.min_kv if squeeze else d.want(step)
            base[d.name] = max(base[d.name], targets[d.name])
    room = budget - sum(base.values())
    active = [d for d in demands if d.activity is Activity.ACTIVE]
    extra = {d.name: max(0, d.want(step) - base[d.name]) for d in active}
    grant = {d.name: 0 for d in active}
    for priority in sorted({d.priority for d in active}, reverse=True):
        tier = [d.name for d in active if d.priority == priority]
        room = _water_fill(tier, extra, grant, room)
    # Leftover room goes to active models up to their caps, so a burst can grow between
    # two looks of the arbiter; it is taken back at the next look if another model needs it.
    for priority in sorted({d.priority for d in active}, reverse=True):
        tier = [d.name for d in active if d.priority == priority]
        headroom = {
            d.name: max(0, d.cap - base[d.name] - grant[d.name]) for d in active if d.name in tier
        }
        room = _water_fill(tier, headroom, grant, room)
    ordered = {d.name: base[d.name] + grant[d.name] for d in sorted(active, key=_by_priority)}
    ordered.update(targets)
    return ordered


def _by_priority(demand: Demand) -> int:
    return -demand.priority


def _water_fill(names: list[str], want: Mapping[str, int], grant: dict[str, int], room: int) -> int:
    """Share ``room`` equally among ``names`` up to ``want`` each (added to ``grant``)."""
    pending = [n for n in names if want[n] > 0]
    wanted = {n: want[n] for n in pending}
    while pending and room > 0:
        share = max(1, room // len(pending))
        for name in list(pending):
            give = min(share, wanted[name], room)
            grant[name] += give
            wanted[name] -= give
            room -= give
            if wanted[name] == 0:
                pending.remove(name)
            if room == 0:
                break
    return room


# -- applying a plan to the ledger ----------------------------------------------------------


@dataclass(frozen=True)
class LimitChange:
    name: str
    old: int | None
    new: int
    revision: int


class LimitWriter:
    """Applies target limits to the ledger, shrinks first, keeping the invariant.

    ``names`` are the ledger instance names of the arbiter's models; ``min_kv`` their
    reservations. Every write carries the revision the arbiter read, so a limit an operator
    changed in between is not overwritten blindly (the next look sees it)."""

    def __init__(self, ledger: Ledger, budget: int, min_kv: Mapping[str, int]) -> None:
        self.ledger = ledger
        self.budget = budget
        self.min_kv = dict(min_kv)

    def records(self) -> dict[str, InstanceInfo]:
        return {i.name: i for i in self.ledger.list_instances() if i.name in self.min_kv}

    def held(self, records: Mapping[str, InstanceInfo]) -> int:
        """Σ max(limit, used, min_kv) over the arbiter's models (min_kv alone without a record)."""
        total = 0
        for name, floor in self.min_kv.items():
            info = records.get(name)
            if info is None:
                total += floor
            else:
                limit = info.limit_desired if info.limit_desired is not None else self.budget
                total += max(limit, info.used_bytes, floor)
        return total

    def apply(self, targets: Mapping[str, int]) -> list[LimitChange]:
        """Write ``targets``: every shrink, then every raise that fits the room left."""
        changes: list[LimitChange] = []
        records = self.records()
        for name, target in targets.items():
            info = records.get(name)
            if info is not None and (info.limit_desired is None or target < info.limit_desired):
                changes.extend(self._write(info, target))
        records = self.records()
        room = self.budget - self.held(records)
        for name, target in targets.items():  # the plan's order: highest priority first
            info = records.get(name)
            if info is None or info.limit_desired is None or target <= info.limit_desired:
                continue
            floor = self.min_kv[name]
            before = max(info.limit_desired, info.used_bytes, floor)
            allowed = min(target, before + max(0, room))
            if allowed <= info.limit_desired:
                continue
            done = self._write(info, allowed)
            if done:
                room -= max(allowed, info.used_bytes, floor) - before
            changes.extend(done)
        return changes

    def set_now(self, name: str, target: int) -> LimitChange | None:
        """One model's limit now (a wake to ``min_kv``, a release to the floor), if the room
        allows it (a raise beyond the reservation is clipped to the room)."""
        records = self.records()
        info = records.get(name)
        if info is None:
            return None
        current = info.limit_desired if info.limit_desired is not None else self.budget
        if target > current:
            floor = self.min_kv[name]
            before = max(current, info.used_bytes, floor)
            target = min(target, before + max(0, self.budget - self.held(records)))
            if target <= current:
                return None
        done = self._write(info, target)
        return done[0] if done else None

    def _write(self, info: InstanceInfo, target: int) -> list[LimitChange]:
        target = max(target, info.floor_bytes)  # the engine holds its floor while it runs
        if info.limit_desired == target:
            return []
        try:
            revision = self.ledger.set_limit(
                info.name, target, expected_revision=info.limit_revision
            )
        except (StaleRevision, UnknownInstance):
            return []  # changed or gone meanwhile: the next look decides again
        except LedgerError as exc:
            logger.warning("serve: cannot set the limit of %r: %s", info.name, exc)
            return []
        return [LimitChange(info.name, info.limit_desired, target, revision)]


def total_committed(infos: Iterable[InstanceInfo]) -> int:
    return sum(i.committed_bytes + i.reserved_bytes for i in infos)


# -- the loop ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelView:
    """What the arbiter reads of a served model on each look."""

    name: str
    min_kv: int
    cap: int
    priority: int
    activity: Activity
    floor: int


LOOK_INTERVAL_S = 0.1


class MemoryArbiter:
    """Owns the budget: looks at the ledger and the models' activity every
    ``LOOK_INTERVAL_S`` (or at once when kicked), plans, and writes limits."""

    def __init__(
        self,
        ledger: Ledger,
        budget: int,
        models: Sequence[ModelView],
        views: Callable[[], Sequence[ModelView]],
        page_size: int,
    ) -> None:
        self.ledger = ledger
        self.budget = budget
        self.writer = LimitWriter(ledger, budget, {m.name: m.min_kv for m in models})
        self._views = views
        self.step = {m.name: max(4 * page_size, m.cap // 8) for m in models}
        self.records: dict[str, InstanceInfo] = {}
        self.raises: dict[str, int] = {m.name: 0 for m in models}
        self.cuts: dict[str, int] = {m.name: 0 for m in models}
        self.peak_committed = 0
        self._last_refusals: dict[str, int] = {}
        self._kick = asyncio.Event()

    def kick(self) -> None:
        """Look again now (a model became active or idle)."""
        self._kick.set()

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            try:
                self.look()
            except LedgerError as exc:
                logger.error("serve: the arbiter cannot read the ledger: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), LOOK_INTERVAL_S)
            self._kick.clear()

    def look(self) -> list[LimitChange]:
        """One pass: read the ledger, plan, write the limits that changed."""
        records = self.writer.records()
        self._observe(records)
        demands = [self._demand(view, records.get(view.name)) for view in self._views()]
        targets = plan_limits(demands, self.budget, max(self.step.values(), default=0))
        changes = self.writer.apply(targets)
        self._count(changes)
        if changes:
            self._observe(self.writer.records())
        return changes

    def _observe(self, records: dict[str, InstanceInfo]) -> None:
        self.records = records
        self.peak_committed = max(self.peak_committed, total_committed(records.values()))

    def _demand(self, view: ModelView, info: InstanceInfo | None) -> Demand:
        if info is None or view.activity is Activity.DOWN:
            return Demand(view.name, view.min_kv, view.cap, view.priority, Activity.DOWN)
        limit = info.limit_desired if info.limit_desired is not None else self.budget
        refused = info.refusals > self._last_refusals.get(view.name, info.refusals)
        self._last_refusals[view.name] = info.refusals
        step = self.step[view.name]
        return Demand(
            view.name,
            view.min_kv,
            view.cap,
            view.priority,
            view.activity,
            used=info.used_bytes,
            limit=limit,
            pressured=refused or info.used_bytes >= limit - step // 2,
            floor=view.floor,
        )

    def _count(self, changes: Iterable[LimitChange]) -> None:
        for change in changes:
            if change.old is None or change.new > change.old:
                self.raises[change.name] += 1
            else:
                self.cuts[change.name] += 1
            logger.debug("serve: %s limit %s -> %d", change.name, change.old, change.new)

    def add(self, view: ModelView, page_size: int) -> None:
        """A model added at run time: its ``min_kv`` is reserved from now on (before its engine
        starts); see :meth:`room_left`."""
        self.writer.min_kv[view.name] = view.min_kv
        self.step[view.name] = max(4 * page_size, view.cap // 8)
        self.raises.setdefault(view.name, 0)
        self.cuts.setdefault(view.name, 0)
        self.kick()

    def remove(self, name: str) -> None:
        """A model removed at run time (its engine stopped): its reservation returns."""
        for table in (self.writer.min_kv, self.step, self.raises, self.cuts, self._last_refusals):
            table.pop(name, None)
        self.records.pop(name, None)
        self.kick()

    def room_left(self) -> int:
        """``B - Σ max(limit, used, min_kv)`` over the models now (negative: over-committed
        until the engines drain to their new limits)."""
        return self.budget - self.writer.held(self.writer.records())

    def set_limit(self, name: str, target: int) -> None:
        """One model's limit now (release to its floor, restore to ``min_kv``)."""
        change = self.writer.set_now(name, target)
        if change is not None:
            self._count([change])
        self._observe(self.writer.records())

    def committed_of(self, name: str) -> int | None:
        """The model's ledger bytes now (None: not registered)."""
        info = self.writer.records().get(name)
        return None if info is None else info.used_bytes
