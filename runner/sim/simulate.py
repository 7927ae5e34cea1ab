"""A discrete-event simulator that runs the real policy code against a synthetic model.

`batchserve simulate SCENARIO.yml [--policy adaptive|fixed|none|bentoml] [--window-ms W]
[--cap N] [--seed S] [--json]`. Time is virtual: the policy sees the simulator's
clock, a batch of n rows costs `(intercept + per_item * n) * lognormal(0, noise)` of CPU (or a
recorded batch's), its wall time is that cost inflated by contention, a heavy tail and stalls
when the scenario asks for them (`batchserve.runner.sim.batch_times`), and Poisson traffic is
played phase by phase. Arrivals and request sizes come from their own random stream, so every
policy meets exactly the same requests for a given seed.

Scenario files are read and checked by `batchserve.runner.sim.scenario`.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..core.config import REFUSE_MODES
from ..policy.base import Batch, Policy, Request
from ..policy.latency_model import Timing
from ..policy.policies import NAMES, make_policy
from .batch_times import BatchTimer
from .scenario import Cost, Phase, Scenario, load_scenario

DEFAULT_FIXED_WINDOW_MS = 5.0


@dataclass(frozen=True, slots=True)
class Result:
    """What one run measured; `to_json` gives every field as a plain dict for JSON."""

    scenario: str
    policy: str
    seconds: float
    requests: int
    ok: int
    rejected: int
    late: int
    goodput_rps: float
    p50_ms: float
    p99_ms: float
    mean_batch_size: float
    false_rejections: int
    rejected_at_arrival: int
    reject_wait_p99_ms: float
    batches: int
    reasons: dict[str, int] = field(default_factory=dict)
    refits: int = 0
    refit_ms_mean: float = 0.0
    refit_ms_max: float = 0.0
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --- the run --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Trace:
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


def simulate(
    scenario: Scenario,
    policy_kind: str = "adaptive",
    *,
    seed: int | None = None,
    policy: Policy | None = None,
    traffic: list[tuple[float, int]] | None = None,
    **policy_kw: Any,
) -> Result:
    """Run one policy through one scenario on a virtual clock. `traffic`, arrival times with
    request sizes in ascending time, replaces the scenario's Poisson phases (whose costs still
    apply): `batchserve plan` plays one process's share of recorded arrivals this way."""
    seed = scenario.seed if seed is None else seed
    slo_s = scenario.slo_ms / 1000.0
    if policy is None:
        policy = make_policy(policy_kind, scenario.max_batch_size, slo_s, **policy_kw)
    noise = random.Random(seed * 7919 + 1)
    machine = random.Random(seed * 7919 + 2)
    _calibrate(policy, scenario.phases[0].cost, noise, machine)
    wall = time.perf_counter()
    traffic = arrivals(scenario, seed) if traffic is None else traffic
    timer = BatchTimer(noise, machine, [arrival for arrival, _ in traffic])
    trace = _run(policy, traffic, scenario, slo_s, timer)
    return _result(scenario, label(policy_kind, policy_kw), trace, time.perf_counter() - wall)


def label(policy_kind: str, policy_kw: dict[str, Any]) -> str:
    """The name a result goes by: the policy's, and its refusal mode when not the default."""
    refuse = policy_kw.get("refuse", "at_arrival")
    return policy_kind if refuse == "at_arrival" else f"{policy_kind} ({refuse})"


def _calibrate(policy: Policy, cost: Cost, noise: random.Random, machine: random.Random) -> None:
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


def _run(
    policy: Policy,
    traffic: list[tuple[float, int]],
    scenario: Scenario,
    slo_s: float,
    timer: BatchTimer,
) -> _Trace:
    trace = _Trace()
    costs = _CostClock(scenario.phases)
    cpu_s = 0.0
    inf = math.inf
    count = len(traffic)
    index = 0
    running: Batch | None = None
    started = done_at = inf
    wake = inf
    while True:
        arrival = traffic[index][0] if index < count else inf
        now = min(arrival, done_at, wake)
        if now == inf:
            break
        if done_at <= arrival and done_at <= wake:
            assert running is not None
            policy.complete(running, started, done_at, cpu_s)
            _answered(trace, running, done_at)
            running, done_at = None, inf
            _refit(policy, now, trace)
        elif arrival <= wake:
            request = Request(index, traffic[index][1], arrival, arrival + slo_s)
            index += 1
            if not policy.offer(request, now):
                trace.refusals.append((request, now))
        else:
            wake = inf
        step = policy.poll(now)
        for request in (*step.expired, *step.refused):
            trace.refusals.append((request, now))
        if step.batch is not None:
            if running is not None:
                raise RuntimeError("the policy released a batch while one was running")
            running, started = step.batch, now
            taken = timer.draw(costs.at(now), step.batch.rows, now)
            cpu_s, done_at = taken.cpu_s, now + taken.wall_s
            _started(trace, step.batch, now, done_at, taken.per_row_s)
        wake = inf if step.wake_at is None else max(step.wake_at, now + 1e-6)
    return trace


class _CostClock:
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


def _started(trace: _Trace, batch: Batch, now: float, done_at: float, per_row_s: float) -> None:
    trace.batch_starts.append(now)
    trace.batch_info.append((done_at, batch.rows, per_row_s))
    trace.reasons[batch.reason] += 1


def _answered(trace: _Trace, batch: Batch, finished: float) -> None:
    slack = math.inf
    for request in batch.requests:
        trace.latencies.append(finished - request.arrival)
        if finished > request.deadline:
            trace.late += 1
        elif request.deadline - finished < slack:
            slack = request.deadline - finished
    trace.batch_slack.append(slack)


def _refit(policy: Policy, now: float, trace: _Trace) -> None:
    """Run a due refit inline, timing it: the live runner runs the same job on a thread."""
    job = policy.refit_job(now)
    if job is None:
        return
    began = time.perf_counter()
    fit = job()
    trace.refit_s.append(time.perf_counter() - began)
    policy.apply_fit(fit)


# --- measures -------------------------------------------------------------------------------


def false_rejections(trace: _Trace, max_batch_size: int) -> int:
    """Refusals that were not needed (docs/dispatcher.md, "false refusal"): how many of the
    refused requests could all have been served on time, together, without making any
    admitted request late.

    In arrival order, a refused request counts if some batch that started after it arrived
    had room for its rows and, with them added at that batch's own per-row time, still
    finished by its deadline, while every answer on time in that batch, and in the later
    batches the extra time pushes back until an idle gap absorbs it, stayed on time. Its rows
    then join that batch, so the refusals after it meet the schedule with them in: judged
    alone, in sustained overload every refusal counted once the batches left each other a
    millisecond to spare, though only a few more requests fitted. The same measure applies
    to every policy.
    """
    schedule = _Schedule(trace)
    count = 0
    for request in sorted((request for request, _ in trace.refusals), key=_arrival):
        first = bisect.bisect_left(schedule.began, request.arrival)
        for i in range(first, bisect.bisect_left(schedule.began, request.deadline)):
            if schedule.fits(i, request, max_batch_size):
                schedule.add(i, request, first)
                count += 1
                break
    return count


def _arrival(request: Request) -> float:
    return request.arrival


class _Schedule:
    """The batches as they ran, with the rows of the refusals counted false added.

    A slip of `d` at batch i pushes batch i+1 back by `max(0, d - gap)`, where `gap` is the
    idle time between them, so backwards: `absorb[i] = min(slack[i], gap + absorb[i+1])`,
    the most batch i's finish may slip without making an on-time answer late.
    """

    def __init__(self, trace: _Trace) -> None:
        self.began = trace.batch_starts  # as they ran: which batches a request could join
        self.starts = list(trace.batch_starts)
        self.ends = [finish for finish, _, _ in trace.batch_info]
        self.rows = [rows for _, rows, _ in trace.batch_info]
        self.per_row = [per_row for _, _, per_row in trace.batch_info]
        self.slack = list(trace.batch_slack)
        self.absorb = [0.0] * len(self.starts)
        if self.starts:
            self._absorb_back(len(self.starts) - 1, 0)

    def fits(self, i: int, request: Request, max_batch_size: int) -> bool:
        extra = self.per_row[i] * request.rows
        return (self.rows[i] + request.rows <= max_batch_size
                and self.ends[i] + extra <= request.deadline
                and extra <= self.absorb[i])

    def add(self, i: int, request: Request, first: int) -> None:
        """Put `request` in batch i and push the batches after it back; `absorb` stays
        right from `first` on (no later refusal looks before it)."""
        extra = self.per_row[i] * request.rows
        self.rows[i] += request.rows
        self.ends[i] += extra
        self.slack[i] = min(self.slack[i] - extra, request.deadline - self.ends[i])
        last = i
        while last + 1 < len(self.starts):
            push = self.ends[last] - self.starts[last + 1]
            if push <= 0.0:
                break
            last += 1
            self.starts[last] += push
            self.ends[last] += push
            self.slack[last] -= push
        self._absorb_back(last, first)

    def _absorb_back(self, last: int, first: int) -> None:
        """`absorb` from batch `last` down to batch `first`, from `absorb[last + 1]`."""
        starts, ends, absorb = self.starts, self.ends, self.absorb
        following = (starts[last + 1] - ends[last] + absorb[last + 1]
                     if last + 1 < len(starts) else math.inf)
        for i in range(last, first - 1, -1):
            absorb[i] = min(self.slack[i], following)
            if i > 0:
                following = starts[i] - ends[i - 1] + absorb[i]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _result(scenario: Scenario, policy: str, trace: _Trace, wall_s: float) -> Result:
    answered = len(trace.latencies)
    waits = [now - request.arrival for request, now in trace.refusals]
    batches = len(trace.batch_starts)
    rows = sum(rows for _, rows, _ in trace.batch_info)
    refit_ms = [seconds * 1000.0 for seconds in trace.refit_s]
    return Result(
        scenario=scenario.name,
        policy=policy,
        seconds=scenario.seconds,
        requests=answered + len(trace.refusals),
        ok=answered,
        rejected=len(trace.refusals),
        late=trace.late,
        goodput_rps=(answered - trace.late) / scenario.seconds,
        p50_ms=_percentile(trace.latencies, 0.50) * 1000.0,
        p99_ms=_percentile(trace.latencies, 0.99) * 1000.0,
        mean_batch_size=rows / batches if batches else 0.0,
        false_rejections=false_rejections(trace, scenario.max_batch_size),
        rejected_at_arrival=sum(1 for wait in waits if wait == 0.0),
        reject_wait_p99_ms=_percentile(waits, 0.99) * 1000.0,
        batches=batches,
        reasons=dict(sorted(trace.reasons.items())),
        refits=len(refit_ms),
        refit_ms_mean=sum(refit_ms) / len(refit_ms) if refit_ms else 0.0,
        refit_ms_max=max(refit_ms, default=0.0),
        wall_s=wall_s,
    )


# --- hindsight grid over fixed settings -----------------------------------------------------

GRID_WINDOWS_MS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0)
GRID_CAPS = (8, 16, 24, 32, 48, 64)


def grid_search(
    scenario: Scenario,
    windows_ms: Sequence[float] = GRID_WINDOWS_MS,
    caps: Sequence[int] = GRID_CAPS,
    *,
    seed: int | None = None,
) -> list[tuple[float, int, Result]]:
    """Every fixed (window, cap) pair on the same traffic, best goodput first."""
    runs = []
    for window_ms in windows_ms:
        for cap in caps:
            if cap > scenario.max_batch_size:
                continue
            result = simulate(scenario, "fixed", seed=seed, window_s=window_ms / 1000.0, cap=cap)
            runs.append((window_ms, cap, result))
    runs.sort(key=lambda run: (-run[2].goodput_rps, run[2].p99_ms))
    return runs


def best_fixed(scenario: Scenario, *, seed: int | None = None) -> tuple[float, int, Result]:
    window_ms, cap, result = grid_search(scenario, seed=seed)[0]
    name = f"fixed({window_ms:g}ms,{cap})"
    return window_ms, cap, replace(result, policy=name)


# --- command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchserve simulate",
        description="Run a batching policy through a traffic scenario on a virtual clock.",
    )
    parser.add_argument("scenario", help="a scenario YAML file (see benchmarks/scenarios/)")
    parser.add_argument("--policy", choices=NAMES, default="adaptive")
    parser.add_argument("--window-ms", type=float, help="window of --policy fixed")
    parser.add_argument("--cap", type=int, help="batch cap of --policy fixed")
    parser.add_argument("--seed", type=int, help="override the scenario's seed")
    parser.add_argument("--refuse", choices=REFUSE_MODES, default="at_arrival",
                        help="when --policy adaptive refuses: at arrival, or the oldest")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str]) -> int:
    """`batchserve simulate ...`; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    kw: dict[str, Any] = {}
    if args.policy == "fixed":
        kw["window_s"] = (DEFAULT_FIXED_WINDOW_MS if args.window_ms is None else args.window_ms)
        kw["window_s"] /= 1000.0
        if args.cap is not None:
            kw["cap"] = args.cap
    elif args.window_ms is not None or args.cap is not None:
        parser.error("--window-ms and --cap apply to --policy fixed only")
    if args.refuse != "at_arrival":
        if args.policy != "adaptive":
            parser.error("--refuse applies to --policy adaptive only")
        kw["refuse"] = args.refuse
    try:
        scenario = load_scenario(args.scenario)
        result = simulate(scenario, args.policy, seed=args.seed, **kw)
    except ValueError as exc:
        print(f"batchserve simulate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json()) if args.json else _describe(result))
    return 0


def _describe(result: Result) -> str:
    share = 100.0 / result.requests if result.requests else 0.0
    return "\n".join([
        f"{result.scenario} · {result.policy} · {result.seconds:g} s simulated",
        f"requests {result.requests}  ok {result.ok}  rejected {result.rejected} "
        f"({result.rejected * share:.2f}%)  late {result.late} ({result.late * share:.2f}%)",
        f"goodput {result.goodput_rps:.1f} req/s  p50 {result.p50_ms:.2f} ms  "
        f"p99 {result.p99_ms:.2f} ms  mean batch {result.mean_batch_size:.1f}",
        f"false rejections {result.false_rejections}  refused at arrival "
        f"{result.rejected_at_arrival}  reasons {result.reasons}",
        f"refits {result.refits} (mean {result.refit_ms_mean:.2f} ms)  wall {result.wall_s:.2f} s",
    ])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
