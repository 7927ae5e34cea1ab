"""What a simulated batch takes: its pure cost (CPU time) and its wall time on a shared machine.

On the live server a batch's wall time holds the model's CPU time plus waits for a core
and for the GIL, which are heavy-tailed, bursty and grow with the arrival rate, while its CPU
time does not. The simulator draws both, so the policy sees in `complete` what it
sees live: `cpu_s` is the cost, `finished - started` the wall time.

    cost  = (intercept + per_item * n) * lognormal(0, noise)   or a replayed batch's CPU time
    base  = cost                                                or that batch's wall time
    wall  = base * (1 + per_krps * arrivals per ms over the last window_ms)   contention
                 * (scale * Pareto(alpha), for a `share` of batches; else 1)  tail
                 + (ms / 1000, with `probability`; else 0)                    stalls

The lognormal factor is drawn from the simulator's noise stream exactly as before these keys
existed; everything else from a second stream, so a scenario without them runs as it did and
one with them meets the same costs batch for batch.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from typing import NamedTuple

from .scenario import Cost


class BatchTime(NamedTuple):
    """A batch's wall and CPU seconds, and the wall seconds one more row would have added (the
    false-refusal measure's per-row time)."""

    wall_s: float
    cpu_s: float
    per_row_s: float


class BatchTimer:
    """Draws batch times; `arrivals` are the traffic's arrival times, ascending, for the rate."""

    def __init__(self, noise: random.Random, machine: random.Random,
                 arrivals: Sequence[float]) -> None:
        self.noise = noise
        self.machine = machine
        self.arrivals = arrivals

    def draw(self, cost: Cost, rows: int, now: float) -> BatchTime:
        if cost.replay is not None:
            sample = cost.replay.sample(rows, self.machine)
            cpu, base = sample.cpu_s, sample.wall_s
            per_row = sample.per_row_s * (base / cpu if cpu > 0.0 else 1.0)
        else:
            factor = self.noise.lognormvariate(0.0, cost.noise) if cost.noise > 0 else 1.0
            cpu = base = cost.mean_s(rows) * factor
            per_row = cost.per_item_ms / 1000.0 * factor
        if not cost.inflated:
            return BatchTime(base, cpu, per_row)
        stretch = self.contention(cost, now) * self.tail(cost)
        stall = self.stall(cost)
        return BatchTime(base * stretch + stall, cpu, per_row * stretch)

    def contention(self, cost: Cost, now: float) -> float:
        """`1 + per_krps * rate`, the rate in thousands of arrivals a second over the window."""
        if cost.contention is None or cost.contention.per_krps == 0.0:
            return 1.0
        window_s = cost.contention.window_ms / 1000.0
        arrived = (bisect.bisect_right(self.arrivals, now)
                   - bisect.bisect_right(self.arrivals, now - window_s))
        return 1.0 + cost.contention.per_krps * arrived / window_s / 1000.0

    def tail(self, cost: Cost) -> float:
        tail = cost.tail
        if tail is None or tail.share == 0.0 or self.machine.random() >= tail.share:
            return 1.0
        return tail.scale * self.machine.paretovariate(tail.alpha)

    def stall(self, cost: Cost) -> float:
        stalls = cost.stalls
        if stalls is None or stalls.probability == 0.0:
            return 0.0
        return stalls.ms / 1000.0 if self.machine.random() < stalls.probability else 0.0
