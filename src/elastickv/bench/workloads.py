"""Seeded arrival schedules over several models: who sends what, when.

* :func:`staggered_ramp` — kvcached's benchmark shape: each model's rate steps 1, 2, …, P, …,
  2, 1 requests/s (one second each, requests evenly spaced within the second), the next
  model starting ``offset`` seconds later, so bursts barely overlap.
* :func:`correlated_burst` — the same ramps, but the first two models peak together.
* :func:`idle_gaps` — short bursts separated by idle gaps long enough for a model's KV to be
  released and its engine stopped, so the next burst pays a wake.

Prompts are token ids (exact lengths, no tokenizer needed); output lengths are drawn per
request from a seeded generator, and ``ignore_eos`` makes every answer that long.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

TOKEN_RANGE = (20, 400)  # ids every built-in tiny model has, away from special tokens


@dataclass(frozen=True)
class Arrival:
    """One request: when (seconds from the start), to which model, and its shape."""

    at: float
    model: str
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Shape:
    """Fixed per run: prompt length and the range of output lengths."""

    prompt_tokens: int = 256
    min_output: int = 32
    max_output: int = 64


def ramp_gap(peak: int) -> float:
    """Seconds between two models' ramps by default: ``peak/4 + 2·peak``, as in kvcached's
    benchmark (a ramp lasts ``2·peak − 1`` s, so bursts barely overlap)."""
    return peak / 4 + 2 * peak


def _ramp_times(start: float, peak: int) -> list[float]:
    rates = list(range(1, peak + 1)) + list(range(peak - 1, 0, -1))
    times: list[float] = []
    for second, rate in enumerate(rates):
        times.extend(start + second + i / rate for i in range(rate))
    return times


def _requests(
    times: Sequence[float], model: str, shape: Shape, rng: random.Random
) -> list[Arrival]:
    return [
        Arrival(
            round(t, 4),
            model,
            tuple(rng.randrange(*TOKEN_RANGE) for _ in range(shape.prompt_tokens)),
            rng.randint(shape.min_output, shape.max_output),
        )
        for t in times
    ]


def staggered_ramp(
    models: Sequence[str], peak: int, *, offset: float | None = None, shape: Shape = Shape(),
    seed: int = 0,
) -> list[Arrival]:  # fmt: skip
    """Ramps 0 → ``peak`` → 1 req/s, model i+1 starting ``offset`` s after model i (default
    :func:`ramp_gap`)."""
    gap = ramp_gap(peak) if offset is None else offset
    rng = random.Random(seed)
    arrivals = []
    for i, model in enumerate(models):
        arrivals += _requests(_ramp_times(i * gap, peak), model, shape, rng)
    return sorted(arrivals, key=lambda a: a.at)


def correlated_burst(
    models: Sequence[str], peak: int, *, offset: float | None = None, shape: Shape = Shape(),
    seed: int = 0,
) -> list[Arrival]:  # fmt: skip
    """The first two models ramp together; the others follow ``offset`` s apart."""
    gap = ramp_gap(peak) if offset is None else offset
    rng = random.Random(seed)
    arrivals = []
    for i, model in enumerate(models):
        start = 0.0 if i < 2 else (i - 1) * gap
        arrivals += _requests(_ramp_times(start, peak), model, shape, rng)
    return sorted(arrivals, key=lambda a: a.at)


def idle_gaps(
    models: Sequence[str], burst: int, *, gap: float, bursts: int = 2, shape: Shape = Shape(),
    seed: int = 0,
) -> list[Arrival]:  # fmt: skip
    """``bursts`` bursts of ``burst`` requests (1 s) per model, ``gap`` seconds apart; the
    models take turns so every model idles ``gap`` s between its bursts."""
    rng = random.Random(seed)
    arrivals = []
    for b in range(bursts):
        for i, model in enumerate(models):
            start = b * gap + i * (gap / max(1, len(models)))
            times = [start + k / burst for k in range(burst)]
            arrivals += _requests(times, model, shape, rng)
    return sorted(arrivals, key=lambda a: a.at)


WORKLOADS = {"ramp": staggered_ramp, "correlated": correlated_burst, "idle": idle_gaps}


def batch(
    model: str, requests: int, *, prompt_tokens: tuple[int, int], max_tokens: int, seed: int = 0
) -> list[Arrival]:
    """``requests`` requests all due at once (for a closed loop), prompts of a seeded length
    in ``prompt_tokens`` (inclusive), every answer ``max_tokens`` long."""
    rng = random.Random(seed)
    return [
        Arrival(
            0.0,
            model,
            tuple(rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(*prompt_tokens))),
            max_tokens,
        )
        for _ in range(requests)
    ]
