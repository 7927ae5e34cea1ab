"""Capacity planning: how many runner processes, and which `max_batch_size`, carry a rate.

`batchserve plan` (`batchserve.runner.sim.plan_cli`) reads a model's cost, the traffic and the
machine; this module is pure and answers, per setting, the highest offered rate that passes
(p99 of OK answers within the limit and under 1% of requests refused, the criterion of the
benchmark sweeps) and what the target rate gets, by running the real policy in the simulator.

Two things the simulator alone does not know (docs/performance.md, "Planning capacity"):

- Several processes. An API worker picks a runner process at random per request, so each of
  `k` processes sees a random `1/k` share of the arrivals (a Poisson `rate/k` when the traffic
  is Poisson). All are alike, so one process is simulated on its share.
- One machine. The processes, the API workers (and a load generator on the same machine) share
  its cores. Their demand in cores is `busy + rate * (front + client) + batches/s * batch +
  model CPU/s`; a batch's wall time is its CPU time stretched by the mean slowdown of a thread
  sharing `c` cores with that demand (`shared_slowdown`), and a demand of `c` cores or more
  cannot be carried at all. The demand depends on the batch sizes the policy chooses,
  which depend on the stretch, so each point is simulated until the two agree.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .recording import Recording
from .scenario import Contention, Cost, Phase, Scenario
from .simulate import Result, simulate

MAX_FAILED = 0.01
"""A rate passes with fewer than this share of requests refused (and p99 within the limit)."""

GRID_POINTS = 6
"""Rates tried per setting, evenly up to the rate that would fill every core with full batches;
the passing rate is then narrowed between the last that passed and the next by bisection."""

BISECTIONS = 3
ROUNDS = 4
"""Simulations at most per point while the stretch and the batch sizes settle."""

SETTLED = 0.05
"""The stretch has settled when a round moves it by less than this share."""


@dataclass(frozen=True, slots=True)
class Machine:
    """The cores and what else uses them, per request and per batch, in CPU seconds.

    `front_s` is the server's CPU per request outside the model's batches (the API workers'
    HTTP, decoding and encoding, and the runner's loop); `batch_s` its CPU per batch outside
    the model thread (the dispatcher's wake and the handoff to the model thread and back);
    `client_s` a load generator's per request when it runs on the same machine; `busy_cores`
    whatever other work takes."""

    cores: int
    front_s: float
    batch_s: float = 0.0
    client_s: float = 0.0
    busy_cores: float = 0.0

    def demand(self, rate: float, batches_per_s: float, model_cpu_per_s: float) -> float:
        """Cores wanted at `rate` requests a second, all processes together."""
        per_request = self.front_s + self.client_s
        return self.busy_cores + rate * per_request + batches_per_s * self.batch_s \
            + model_cpu_per_s

    def client_wait_s(self, rate: float, stretch: float) -> float:
        """The p99 of how late a load generator on this machine sends: it is one process (one
        event loop), a queue of its own whose service is its CPU per request, slowed like any
        other work; infinite when it cannot keep up. Latency counts from when a request was
        due, so this is in every answer's. The waiting time of an M/M/1 queue exceeds `t`
        with chance `u * exp(-(1/service - rate) * t)`, `u` its utilization."""
        service = self.client_s * stretch
        if service <= 0.0:
            return 0.0
        busy = rate * service
        if busy >= 1.0:
            return float("inf")
        return max(0.0, math.log(100.0 * busy)) / (1.0 / service - rate)

    def stretch(self, demand: float) -> float:
        """Wall time over CPU time of a batch, with `demand` cores of work on the machine;
        infinite when the cores cannot keep up (`shared_slowdown`)."""
        return shared_slowdown(self.cores, demand)


def shared_slowdown(cores: int, demand: float) -> float:
    """How much slower a thread runs on `cores` cores that carry `demand` cores of work in all
    (below `cores`). The runnable threads at a moment are taken as a Poisson number; the cores
    run at most `cores` of them, shared evenly, and each runs `slowdown` times longer than its
    CPU time, so by Little's law the runnable threads number `demand * slowdown` on average.
    The slowdown is where the cores' mean work, `E[min(n, cores)]`, meets `demand`: on one core
    `-ln(1 - demand) / demand`.

    The work here is event loops and a model thread that wait on one another, not jobs that
    arrive whatever happens and queue (M/M/c: a slowdown of 3 to 7 at 1.65 to 1.85 cores of
    work on two cores). The batch logs of the bundled `mlp` there show 1.4 to 1.9 times the
    CPU time; this says 1.56 to 1.96."""
    if demand <= 0.0:
        return 1.0
    if demand >= cores:
        return float("inf")
    low, high = demand, 2.0 * demand + cores
    while _busy_cores(cores, high) < demand:
        high *= 2.0
    for _ in range(60):
        middle = (low + high) / 2.0
        low, high = (middle, high) if _busy_cores(cores, middle) < demand else (low, middle)
    return high / demand


def _busy_cores(cores: int, runnable: float) -> float:
    """`E[min(n, cores)]` for `n` Poisson with mean `runnable`."""
    chance, fewer, busy = math.exp(-runnable), 0.0, 0.0
    for n in range(cores):
        fewer += chance
        busy += chance * n
        chance *= runnable / (n + 1)
    return busy + cores * (1.0 - fewer)


@dataclass(frozen=True, slots=True)
class Traffic:
    """The shape of the offered load, to be scaled to any mean rate: Poisson `phases` of
    (seconds, requests a second), or `recorded` arrival times (from 0, ascending) played as
    they are, compressed or stretched in time. `rows` per request."""

    phases: tuple[tuple[float, float], ...]
    recorded: tuple[float, ...] = ()
    rows: int = 1

    @classmethod
    def from_arrivals(cls, times: Sequence[float], rows: int = 1) -> Traffic:
        if len(times) < 2:
            raise ValueError("recorded arrivals must hold at least two times")
        ordered = sorted(times)
        span = ordered[-1] - ordered[0]
        if span <= 0.0:
            raise ValueError("recorded arrivals must span some time")
        recorded = tuple(t - ordered[0] for t in ordered)
        return cls(((span, len(recorded) / span),), recorded, rows)

    @property
    def seconds(self) -> float:
        return sum(seconds for seconds, _ in self.phases)

    @property
    def mean_rate(self) -> float:
        return sum(seconds * rate for seconds, rate in self.phases) / self.seconds

    def at(self, rate: float) -> Traffic:
        """The same shape with mean `rate`."""
        factor = rate / self.mean_rate
        phases = tuple((seconds / (factor if self.recorded else 1.0), r * factor)
                       for seconds, r in self.phases)
        recorded = tuple(t / factor for t in self.recorded)
        return Traffic(phases, recorded, self.rows)

    def share(self, processes: int, seed: int) -> list[tuple[float, int]] | None:
        """One process's arrivals out of recorded ones (each kept with chance `1/processes`,
        as the API workers' random choice does), or None for Poisson phases, which the
        simulator draws itself at the share's rate."""
        if not self.recorded:
            return None
        rng = random.Random(seed)
        return [(t, self.rows) for t in self.recorded if rng.random() * processes < 1.0]


@dataclass(frozen=True, slots=True)
class Inputs:
    """Everything a plan is made from: the model's cost per batch (CPU time: a synthetic line
    or a replayed recording), the machine, the traffic's shape and the latency limit."""

    cost: Cost
    machine: Machine
    traffic: Traffic
    limit_ms: float
    seed: int = 1
    policy: str = "adaptive"

    def cpu_line(self) -> tuple[float, float]:
        """Intercept and slope of a batch's CPU seconds against its rows."""
        replay = self.cost.replay
        if replay is not None:
            return replay.intercept_s, replay.slope_s
        return self.cost.intercept_ms / 1000.0, self.cost.per_item_ms / 1000.0


def cpu_only(recording: Recording) -> Recording:
    """A recording whose batches take their CPU time as wall time. A log's wall times hold the
    contention of the machine and the load it was recorded under; a plan models its own."""
    times = tuple(tuple((cpu if cpu > 0.0 else wall,) * 2 for wall, cpu in group)
                  for group in recording.times)
    return replace(recording, times=times)


@dataclass(frozen=True, slots=True)
class Setting:
    processes: int
    max_batch_size: int


@dataclass(frozen=True, slots=True)
class Point:
    """One offered rate under one setting, all processes together. `p99_ms` is of the OK
    answers, the front's own (stretched) time included; `refused` the share of requests not
    answered; `busy` the cores demanded over the cores there are (1 or more: `saturated`)."""

    rate: float
    goodput_rps: float
    p99_ms: float
    refused: float
    busy: float
    stretch: float
    mean_batch: float
    passed: bool

    @property
    def saturated(self) -> bool:
        return self.busy >= 1.0


@dataclass(frozen=True, slots=True)
class SettingPlan:
    """A setting's passing rate, its point at the target rate, and its goodput curve."""

    setting: Setting
    passing_rps: float
    target: Point
    curve: tuple[Point, ...]


# --- one point ------------------------------------------------------------------------------


def evaluate(inputs: Inputs, setting: Setting, rate: float, batch_guess: float = 1.0) -> Point:
    """Simulate one process's share of `rate`, its batches stretched by the machine's demand
    for batches of some mean size, until the batches it ran give back (nearly) that stretch.
    Each round moves the assumed size halfway (geometrically) to the one seen: a jump all the
    way overshoots, since smaller batches mean more demand, hence slower and larger batches."""
    machine, largest = inputs.machine, float(setting.max_batch_size)
    traffic = inputs.traffic.at(rate)
    rows = min(max(batch_guess, 1.0), largest)
    for _ in range(ROUNDS):
        demand = _demand(inputs, traffic, rows)
        if demand >= machine.cores and rows < largest:
            rows = largest  # the most the policy could do to lower the demand
            demand = _demand(inputs, traffic, rows)
        if demand >= machine.cores:
            return Point(rate, 0.0, float("inf"), 1.0, demand / machine.cores, float("inf"),
                         rows, False)
        result = _run(inputs, traffic, setting, rows)
        seen = min(max(result.mean_batch_size, 1.0), largest)
        before = machine.stretch(demand)
        if abs(machine.stretch(_demand(inputs, traffic, seen)) - before) <= SETTLED * before:
            break
        rows = (rows * seen) ** 0.5
    return _point(inputs, setting, rate, result, demand)


def _demand(inputs: Inputs, traffic: Traffic, rows: float) -> float:
    """The busiest phase's demand in cores, with batches of `rows` on average."""
    return max(phase_demand(inputs, rate * traffic.rows, rows) for _, rate in traffic.phases)


def phase_demand(inputs: Inputs, rows_per_s: float, batch_rows: float) -> float:
    """Cores wanted at `rows_per_s` rows a second in batches of `batch_rows` on average."""
    intercept, slope = inputs.cpu_line()
    batches = rows_per_s / batch_rows
    requests = rows_per_s / max(inputs.traffic.rows, 1)
    return inputs.machine.demand(requests, batches, batches * intercept + rows_per_s * slope)


def _run(inputs: Inputs, traffic: Traffic, setting: Setting, batch_rows: float) -> Result:
    """One process's share, each phase's batches stretched for that phase's demand."""
    k = setting.processes
    phases = []
    for seconds, rate in traffic.phases:
        stretch = inputs.machine.stretch(phase_demand(inputs, rate * traffic.rows, batch_rows))
        share = rate / k
        per_krps = (stretch - 1.0) / (share / 1000.0) if share > 0.0 else 0.0
        cost = replace(inputs.cost, contention=Contention(per_krps) if per_krps > 0 else None)
        phases.append(Phase(seconds, share, cost))
    scenario = Scenario(
        name="plan", slo_ms=inputs.limit_ms, max_batch_size=setting.max_batch_size,
        seed=inputs.seed, size_min=traffic.rows, size_max=traffic.rows, phases=tuple(phases),
    )
    return simulate(scenario, inputs.policy, traffic=traffic.share(k, inputs.seed))


def _point(inputs: Inputs, setting: Setting, rate: float, result: Result,
           demand: float) -> Point:
    stretch = inputs.machine.stretch(demand)
    refused = result.rejected / result.requests if result.requests else 0.0
    p99_ms = result.p99_ms + (inputs.machine.front_s * stretch
                              + inputs.machine.client_wait_s(rate, stretch)) * 1000.0
    passed = p99_ms <= inputs.limit_ms and refused < MAX_FAILED
    return Point(rate, result.goodput_rps * setting.processes, p99_ms, refused,
                 demand / inputs.machine.cores, stretch, result.mean_batch_size, passed)


# --- a setting, and the whole plan ----------------------------------------------------------


def ceiling(inputs: Inputs, setting: Setting) -> float:
    """The offered rate at which full batches would take every core: no rate above passes."""
    intercept, slope = inputs.cpu_line()
    machine, rows = inputs.machine, inputs.traffic.rows
    per_request = machine.front_s + machine.client_s \
        + rows * ((machine.batch_s + intercept) / setting.max_batch_size + slope)
    return max(machine.cores - machine.busy_cores, 0.0) / per_request


def plan_setting(inputs: Inputs, setting: Setting, target: float) -> SettingPlan:
    """The grid of rates, the passing rate narrowed by bisection, and the target's point."""
    top = ceiling(inputs, setting)
    curve: list[Point] = []
    guess = 1.0
    for i in range(1, GRID_POINTS + 1):
        curve.append(evaluate(inputs, setting, top * i / GRID_POINTS, guess))
        guess = curve[-1].mean_batch
    passed = [point for point in curve if point.passed]
    low = passed[-1].rate if passed else 0.0
    high = next((p.rate for p in curve if p.rate > low and not p.passed), top)
    for _ in range(BISECTIONS):
        middle = (low + high) / 2.0
        point = evaluate(inputs, setting, middle, guess)
        curve.append(point)
        low, high = (middle, high) if point.passed else (low, middle)
    at_target = evaluate(inputs, setting, target, guess)
    curve.append(at_target)
    curve.sort(key=lambda point: point.rate)
    return SettingPlan(setting, low, at_target, tuple(curve))


def plan(inputs: Inputs, settings: Sequence[Setting], target: float) -> list[SettingPlan]:
    """Every setting, fewest processes and then smallest `max_batch_size` first."""
    ordered = sorted(settings, key=lambda s: (s.processes, s.max_batch_size))
    return [plan_setting(inputs, setting, target) for setting in ordered]


def recommend(plans: Sequence[SettingPlan]) -> SettingPlan | None:
    """The smallest setting (fewest processes, then smallest batches) that passes at the
    target rate, or None."""
    return next((p for p in plans if p.target.passed), None)
