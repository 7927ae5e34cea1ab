"""Arrival schedules for the load generator: when each request is sent, drawn before the run.

Every pattern is a Poisson process whose rate is a step function of time, and every pattern's
mean rate over whole periods is the rate asked for, so runs of different patterns at the same
rate offer the same load and differ only in how it is spread:

- ``poisson``: a constant rate; gaps between sends are exponential.
- ``burst``: on/off periods of :data:`BURST_PERIOD_S`. The first :data:`BURST_ON` of each period
  runs at ``rate / BURST_ON`` (4x the rate), the rest of the period sends nothing. It shows what
  the batcher does with queues that fill at once and then drain.
- ``step``: the first half of the run at :data:`STEP_LOW` x the rate, the second half at
  :data:`STEP_HIGH` x the rate. It shows how fast the batcher adapts to a sudden change.

Inside a segment of constant rate the gaps are exponential; a new segment starts its own
draws at its start, which is exact for a Poisson process (it has no memory).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Pattern = Literal["poisson", "burst", "step"]

BURST_PERIOD_S = 1.0
BURST_ON = 0.25
STEP_LOW = 0.5
STEP_HIGH = 1.5


@dataclass(frozen=True)
class Segment:
    """From ``start`` to ``end`` seconds, arrivals at ``rate`` per second."""

    start: float
    end: float
    rate: float


def _constant(rate: float, seconds: float) -> list[Segment]:
    return [Segment(0.0, seconds, rate)]


def _burst(rate: float, seconds: float) -> list[Segment]:
    segments: list[Segment] = []
    start = 0.0
    while start < seconds:
        on_end = min(start + BURST_PERIOD_S * BURST_ON, seconds)
        segments.append(Segment(start, on_end, rate / BURST_ON))
        if on_end < seconds:
            segments.append(Segment(on_end, min(start + BURST_PERIOD_S, seconds), 0.0))
        start += BURST_PERIOD_S
    return segments


def _step(rate: float, seconds: float) -> list[Segment]:
    half = seconds / 2
    return [Segment(0.0, half, rate * STEP_LOW), Segment(half, seconds, rate * STEP_HIGH)]


PROFILES: dict[str, Callable[[float, float], list[Segment]]] = {
    "poisson": _constant,
    "burst": _burst,
    "step": _step,
}


def profile(pattern: Pattern, rate: float, seconds: float) -> list[Segment]:
    """The rate over time of ``pattern`` at mean ``rate`` for ``seconds``."""
    if not (0 < rate < math.inf and 0 < seconds < math.inf):
        raise ValueError(f"rate and seconds must be positive, got rate={rate} seconds={seconds}")
    if pattern not in PROFILES:
        raise ValueError(f"pattern {pattern!r} is not one of {', '.join(PROFILES)}")
    return PROFILES[pattern](rate, seconds)


def arrivals(segments: list[Segment], rng: random.Random) -> list[float]:
    """Send offsets (seconds from start) of a Poisson process following ``segments``."""
    offsets: list[float] = []
    for segment in segments:
        if segment.rate <= 0:
            continue
        t = segment.start + rng.expovariate(segment.rate)
        while t < segment.end:
            offsets.append(t)
            t += rng.expovariate(segment.rate)
    return offsets


def schedule(
    rate: float, seconds: float, seed: int = 0, pattern: Pattern = "poisson"
) -> list[float]:
    """Send offsets of ``pattern`` at mean ``rate`` for ``seconds``, the same for the same seed."""
    return arrivals(profile(pattern, rate, seconds), random.Random(seed))
