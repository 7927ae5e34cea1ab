"""A discrete-event simulator that runs the real policy code against a synthetic model.

`batchserve simulate SCENARIO.yml [--policy adaptive|fixed|none|bentoml] [--window-ms W]
[--cap N] [--seed S] [--json]`; with `--pipeline NAME [--config PATH]`, a pipeline's steps in
turn (`batchserve.runner.sim.pipeline`). Time is virtual: the policy sees the simulator's
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.config import REFUSE_MODES, load
from ..policy.base import Batch, Policy, Request
from ..policy.policies import NAMES, make_policy
from .batch_times import BatchTimer
from .pipeline import describe as describe_pipeline
from .pipeline import simulate_pipeline, stations
from .scenario import Scenario, load_scenario
from .trace import (
    CostClock,
    Trace,
    arrivals,
    batch_answered,
    calibrate,
    percentile,
    refit,
    start_batch,
)

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
    calibrate(policy, scenario.phases[0].cost, noise, machine)
    wall = time.perf_counter()
    traffic = arrivals(scenario, seed) if traffic is None else traffic
    timer = BatchTimer(noise, machine, [arrival for arrival, _ in traffic])
    trace = _run(policy, traffic, scenario, slo_s, timer)
    return _result(scenario, label(policy_kind, policy_kw), trace, time.perf_counter() - wall)


def label(policy_kind: str, policy_kw: dict[str, Any]) -> str:
    """The name a result goes by: the policy's, and its refusal mode when not the default."""
    refuse = policy_kw.get("refuse", "at_arrival")
    return policy_kind if refuse == "at_arrival" else f"{policy_kind} ({refuse})"


def _run(
    policy: Policy,
    traffic: list[tuple[float, int]],
    scenario: Scenario,
    slo_s: float,
    timer: BatchTimer,
) -> Trace:
    trace = Trace()
    costs = CostClock(scenario.phases)
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
            batch_answered(trace, running, done_at)
            running, done_at = None, inf
            refit(policy, now, trace)
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
            taken = start_batch(trace, timer, costs, step.batch, now)
            cpu_s, done_at = taken.cpu_s, now + taken.wall_s
        wake = inf if step.wake_at is None else max(step.wake_at, now + 1e-6)
    return trace


# --- measures -------------------------------------------------------------------------------


def false_rejections(trace: Trace, max_batch_size: int) -> int:
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

    def __init__(self, trace: Trace) -> None:
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


def _result(scenario: Scenario, policy: str, trace: Trace, wall_s: float) -> Result:
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
        p50_ms=percentile(trace.latencies, 0.50) * 1000.0,
        p99_ms=percentile(trace.latencies, 0.99) * 1000.0,
        mean_batch_size=rows / batches if batches else 0.0,
        false_rejections=false_rejections(trace, scenario.max_batch_size),
        rejected_at_arrival=sum(1 for wait in waits if wait == 0.0),
        reject_wait_p99_ms=percentile(waits, 0.99) * 1000.0,
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
    parser.add_argument("--pipeline", help="simulate this pipeline of --config: its steps in "
                        "turn, each its runner's policy, under its one limit")
    parser.add_argument("--config", type=Path, default=Path("configuration.yml"),
                        help="the configuration that holds --pipeline (default: %(default)s)")
    parser.add_argument("--policy", choices=NAMES)
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
    if args.pipeline is not None:
        if args.policy or args.window_ms is not None or args.cap is not None \
                or args.refuse != "at_arrival":
            parser.error("--policy, --window-ms, --cap and --refuse apply to one runner; each "
                         "step of --pipeline runs the policy its runner is configured with")
        return _simulate_pipeline(args)
    args.policy = args.policy or "adaptive"
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


def _simulate_pipeline(args: argparse.Namespace) -> int:
    try:
        scenario, steps = stations(load(args.config), args.pipeline,
                                   load_scenario(args.scenario), str(args.config))
        result = simulate_pipeline(scenario, args.pipeline, steps, seed=args.seed)
    except ValueError as exc:
        print(f"batchserve simulate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json()) if args.json else describe_pipeline(result))
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
