"""The bookkeeping of a simulated runner process, shared by the simulator of one runner
(`batchserve.runner.sim.simulate`) and of a pipeline (`batchserve.runner.sim.pipeline`): the
traffic's arrivals, the cost in force phase by phase, the calibration before traffic, and
what a process ran and answered (`Trace`), with its refits timed.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..policy.base import Batch, Policy, Request
from ..policy.latency_model import Timing
from .batch_times import BatchTime, BatchTimer
from .scenario import Cost, Phase, Scenario


@dataclass(slots=True)
class Trace:
    """Mutable tallies of one run; turned into a frozen `Result` at the end."""

    latencies: list[float] = field(default_factory=list)
    late: int = 0
    refusals: list[tuple[Request, float]] = field(default_factory=list)
    batch_starts: list[float] = field(default_factory=list)
    batch_info: list[tuple[float, int, float]] = field(default_factory=list)  # finish, rows, x
    batch_slack: list[float] = field(default_factory=list)  # least on-time slack of a batch
    reasons: Counter[str] = field(default_factory=Counter)
    refit_s: list[float] = field(default_factory=list)


def arrivals(scenario: Scenario, seed: int) -> list[tuple[float, int]]:
    """Poisson arrival times with their request sizes, phase by phase."""
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    start = 0.0
    low, high = scenario.size_min, scenario.size_max
    for phase in scenario.phases:
        end = start + phase.seconds
        if phase.rate > 0:
            t = start + rng.expovariate(phase.rate)
            while t < end:
                out.append((t, low if low == high else rng.randint(low, high)))
                t += rng.expovariate(phase.rate)
        start = end
    return out


def calibrate(policy: Policy, cost: Cost, noise: random.Random, machine: random.Random) -> None:
    """Time the policy's calibration sizes before traffic, as the live runner does: on an idle
    machine, so wall time is the cost (a replayed batch's CPU time)."""
    timings = []
    for rows in policy.calibration_sizes():
        if cost.replay is not None:
            seconds = cost.replay.sample(rows, machine).cpu_s
        else:
            seconds = cost.mean_s(rows) * noise.lognormvariate(0.0, cost.noise)
        timings.append(Timing(rows, seconds, seconds))
    policy.calibrate(timings)


class CostClock:
    """The cost in force at a time; times only move forward, so lookups are O(1) amortised."""

    def __init__(self, phases: Sequence[Phase]) -> None:
        self.ends = list(_cumulative(phase.seconds for phase in phases))
        self.costs = [phase.cost for phase in phases]
        self.index = 0

    def at(self, now: float) -> Cost:
        while self.index < len(self.ends) - 1 and now >= self.ends[self.index]:
            self.index += 1
        return self.costs[self.index]


def _cumulative(values: Iterable[float]) -> Iterable[float]:
    total = 0.0
    for value in values:
        total += value
        yield total


def start_batch(trace: Trace, timer: BatchTimer, costs: CostClock, batch: Batch, now: float
                ) -> BatchTime:
    """A batch released at `now`: its times drawn on the cost in force, its start recorded."""
    taken = timer.draw(costs.at(now), batch.rows, now)
    trace.batch_starts.append(now)
    trace.batch_info.append((now + taken.wall_s, batch.rows, taken.per_row_s))
    trace.reasons[batch.reason] += 1
    return taken


def batch_answered(trace: Trace, batch: Batch, finished: float) -> None:
    slack = math.inf
    for request in batch.requests:
        trace.latencies.append(finished - request.arrival)
        if finished > request.deadline:
            trace.late += 1
        elif request.deadline - finished < slack:
            slack = request.deadline - finished
    trace.batch_slack.append(slack)


def refit(policy: Policy, now: float, trace: Trace) -> None:
    """Run a due refit inline, timing it: the live runner runs the same job on a thread."""
    job = policy.refit_job(now)
    if job is None:
        return
    began = time.perf_counter()
    fit = job()
    trace.refit_s.append(time.perf_counter() - began)
    policy.apply_fit(fit)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
