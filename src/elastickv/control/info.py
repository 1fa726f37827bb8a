"""What the ledger reports: frozen descriptions for the API, the CLI and monitors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceInfo:
    """One registered instance.

    ``limit_desired`` is what the operator asked for (None: no per-instance limit).
    ``limit_effective`` is the ceiling in force now: the desired limit capped by the device
    budget, raised to what the instance already holds while it drains after a shrink. Growth is
    admitted only below ``min(desired, budget)``; once the instance has released down to it,
    effective == desired (``draining`` is False).
    """

    name: str
    pid: int
    alive: bool
    slot: int
    limit_desired: int | None
    limit_effective: int
    limit_revision: int
    committed_bytes: int
    reserved_bytes: int
    peak_bytes: int
    admissions: int
    refusals: int
    releases: int
    registered_at: float
    floor_bytes: int = 0  # held for the instance's whole life: no limit below it is accepted
    # The model's weights (``elastickv serve``'s asleep tier): sleep asked for, the owner's
    # answer (asleep now), or its refusal (it cannot release them: a GPU engine started
    # without vLLM's sleep mode).
    sleep_wanted: bool = False
    asleep: bool = False
    sleep_refused: bool = False

    @property
    def used_bytes(self) -> int:
        """Committed plus reserved: what counts against the limit and the device budget."""
        return self.committed_bytes + self.reserved_bytes

    @property
    def over_limit_bytes(self) -> int:
        """How much the instance must still release to get under its (shrunk) limit."""
        if self.limit_desired is None:
            return 0
        return max(0, self.used_bytes - self.limit_desired)

    @property
    def draining(self) -> bool:
        return self.over_limit_bytes > 0


@dataclass(frozen=True)
class DeviceUsage:
    """The device budget and how much of it the live instances use."""

    device: str
    path: str
    total_bytes: int
    utilization: float
    headroom_bytes: int
    budget_bytes: int
    committed_bytes: int
    reserved_bytes: int
    instances: int
    capacity: int
    generation: int
    reclaimed: int

    @property
    def used_bytes(self) -> int:
        return self.committed_bytes + self.reserved_bytes

    @property
    def available_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes)


@dataclass(frozen=True)
class LedgerSnapshot:
    """A consistent view: usage and instances read under one lock."""

    usage: DeviceUsage
    instances: tuple[InstanceInfo, ...]
    taken_at: float
