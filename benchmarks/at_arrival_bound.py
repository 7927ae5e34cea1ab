"""How much goodput a rule that refuses at arrival reaches on a scenario when it knows the
true cost: the targets against BentoML's rule set against a frontier, not only against the
adaptive policy.

    python -m benchmarks.at_arrival_bound [SCENARIO ...] [--reserves 0,0.5,1,2,3] [--seed N]
    python -m benchmarks.at_arrival_bound --doc docs/dispatcher-results.md [--seed N] [--workers N]

The refusal-wait target (p99 within 10% of the limit) leaves a policy on a tight limit no time
to wait for the batch running when a request arrives: it must decide at once. `KnownLinePolicy`
decides at arrival like the adaptive policy, but knows what no live policy can: the scenario's
true cost line and noise, so nothing is lost to estimation. It does not know the future
arrivals or how long the running batch will really take. Its goodput against its lateness, as
the reserve (in sigmas of the known noise) shrinks, is a frontier for this way of deciding;
the same run without noise shows what not knowing the future arrivals alone costs.

Two rules on the same known line show where BentoML's extra goodput comes from:
`DecideLaterPolicy` settles each request only when the running batch ends or when 10% of the
limit has passed, so it knows more and still keeps the refusal-wait target; `DropOldestPolicy`
admits everything and, when the model frees, refuses the oldest requests the batch would
make late, as BentoML does. Each row gives the refusal wait p99 beside goodput and lateness.

Only scenarios whose cost is a plain line with lognormal noise qualify (no replay, contention,
tail or stalls): for those the truth is known in closed form.

`--doc FILE` runs every bundled scenario with and without noise and puts one table, the
adaptive policy against the known-line frontier, between the lines `<!-- at-arrival-bound:
start -->` and `<!-- at-arrival-bound: end -->` of FILE (`summary`).
"""

from __future__ import annotations

import argparse
import bisect
import math
import sys
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from batchserve.runner.policy.base import Batch, Policy, PolicyStats, Request, Step, WithoutModel
from batchserve.runner.policy.latency_model import RateEstimator
from batchserve.runner.sim.scenario import Cost, Scenario, load_scenario
from batchserve.runner.sim.simulate import Result, simulate
from benchmarks.live_table import replace_block

SCENARIOS = Path(__file__).parent / "scenarios"
DEFAULT_SCENARIOS = ("tight_12ms", "tight_slo", "bursts")
RESERVES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)
RATE_TAU_S = 0.1
LATE_FLOOR = 0.001
DECIDE_WITHIN = 0.1
"""How long a deferred decision may wait, as a share of the limit: the refusal-wait target."""
DOC_START = "<!-- at-arrival-bound: start -->"
DOC_END = "<!-- at-arrival-bound: end -->"
WORKERS = 2


class KnownLinePolicy(WithoutModel):
    """Refuse at arrival, FIFO, on the scenario's true cost line and noise.

    - releases everything queued (up to the cap) as soon as the model is free: on a tight
      limit no hold pays;
    - admits a request if its batch (the queued rows, its own, and the rows expected to join
      at the admitted rate until that batch starts) ends by its deadline at `reserve` sigmas
      over the running batch and its own, and if the batch as it stands now, with its rows,
      still ends by the earliest deadline in it: so joiners never make an earlier promise late.
    """

    def __init__(self, scenario: Scenario, reserve: float) -> None:
        self.cap = scenario.max_batch_size
        self.reserve = reserve
        self._ends = list(_cumulative(phase.seconds for phase in scenario.phases))
        self._costs = [phase.cost for phase in scenario.phases]
        for cost in self._costs:
            if cost.inflated:
                raise ValueError(f"scenario {scenario.name} has replayed or inflated batch times; "
                                 "the bound needs a plain cost line with lognormal noise")
        self._queue: deque[Request] = deque()
        self._queued_rows = 0
        self._running_end: float | None = None
        self._running_s = 0.0
        self._admitted = RateEstimator(RATE_TAU_S)

    def _cost(self, now: float) -> Cost:
        index = bisect.bisect_right(self._ends, now)
        return self._costs[min(index, len(self._costs) - 1)]

    def offer(self, request: Request, now: float) -> bool:
        if self._running_end is None and not self._queue:
            return self._admit(request, now)
        return self._fits(request, now) and self._admit(request, now)

    def _fits(self, request: Request, now: float) -> bool:
        """Whether `request`, joining the queue now, keeps its deadline and the earliest one
        in its batch, at the reserve."""
        cost = self._cost(now)
        start = now if self._running_end is None else max(self._running_end, now)
        ahead, members = self._batches_ahead(request)
        squares = self._running_s**2
        for rows_ahead in ahead:
            batch_s = cost.mean_s(rows_ahead)
            start += batch_s
            squares += batch_s**2
        rows = sum(member.rows for member in members) + request.rows
        joining = self._admitted.rate(now) * (start - now)
        own_s = cost.mean_s(min(self.cap, rows + joining))
        if start + own_s + self.reserve * cost.noise * math.sqrt(squares + own_s**2) > \
                request.deadline:
            return False
        if members:
            now_s = cost.mean_s(rows)
            earliest = min(member.deadline for member in members)
            if start + now_s + self.reserve * cost.noise * math.sqrt(squares + now_s**2) > \
                    earliest:
                return False
        return True

    def _batches_ahead(self, request: Request) -> tuple[list[int], list[Request]]:
        """The rows of each batch the queue makes before the one `request` would join, and
        that batch's queued members: the batches `poll` will release, FIFO up to the cap."""
        ahead: list[int] = []
        members: list[Request] = []
        rows = 0
        for queued in self._queue:
            if members and rows + queued.rows > self.cap:
                ahead.append(rows)
                members, rows = [], 0
            members.append(queued)
            rows += queued.rows
        if members and rows + request.rows > self.cap:
            ahead.append(rows)
            members = []
        return ahead, members

    def _admit(self, request: Request, now: float) -> bool:
        self._admitted.add(now, request.rows)
        self._queue.append(request)
        self._queued_rows += request.rows
        return True

    def poll(self, now: float) -> Step:
        if self._running_end is not None or not self._queue:
            return Step()
        taken: list[Request] = []
        rows = 0
        while self._queue and rows + self._queue[0].rows <= self.cap:
            request = self._queue.popleft()
            taken.append(request)
            rows += request.rows
        self._queued_rows -= rows
        self._running_s = self._cost(now).mean_s(rows)
        self._running_end = now + self._running_s
        return Step(batch=Batch(tuple(taken), "idle"))

    def complete(
        self, batch: Batch, started: float, finished: float, cpu_s: float | None = None
    ) -> None:
        self._running_end = None
        self._running_s = 0.0

    def stats(self, now: float) -> PolicyStats:
        return PolicyStats(window_s=0.0, cap=self.cap, intercept_s=0.0, slope_s=0.0,
                           p99_batch_s=0.0, arrival_rps=0.0, queued=len(self._queue))


class DecideLaterPolicy(KnownLinePolicy):
    """`KnownLinePolicy`, but each request is settled only when the running batch ends or
    `horizon_s` after its arrival, whichever comes first, in the order requests arrived.

    Settled at a batch's end, the start of its own batch is known exactly; settled at the
    horizon, the rule has seen who arrived meanwhile. A refusal waits at most `horizon_s`.
    """

    def __init__(self, scenario: Scenario, reserve: float, horizon_s: float) -> None:
        super().__init__(scenario, reserve)
        self.horizon_s = horizon_s
        self._pending: deque[Request] = deque()

    def offer(self, request: Request, now: float) -> bool:
        if self._running_end is None and not self._queue and not self._pending:
            return self._admit(request, now)
        self._pending.append(request)
        return True

    def poll(self, now: float) -> Step:
        every = self._running_end is None
        pending, refused = self._pending, []
        while pending and (every or pending[0].arrival + self.horizon_s <= now):
            request = pending.popleft()
            if self._fits(request, now):
                self._admit(request, now)
            else:
                refused.append(request)
        step = super().poll(now)
        wake_at = pending[0].arrival + self.horizon_s if pending else None
        return Step(batch=step.batch, expired=tuple(refused), wake_at=wake_at)


class DropOldestPolicy(KnownLinePolicy):
    """Admit every request; when the model frees, refuse the oldest while the batch the queue
    makes would end past its deadline at `reserve` sigmas: BentoML's choice of whom to
    refuse, on the known line. A refusal waits for the batch that was running."""

    def offer(self, request: Request, now: float) -> bool:
        return self._admit(request, now)

    def poll(self, now: float) -> Step:
        dropped: list[Request] = []
        if self._running_end is None:
            cost = self._cost(now)
            queue = self._queue
            while queue:
                batch_s = cost.mean_s(min(self.cap, self._queued_rows))
                if now + batch_s * (1.0 + self.reserve * cost.noise) <= queue[0].deadline:
                    break
                request = queue.popleft()
                self._queued_rows -= request.rows
                dropped.append(request)
        return Step(batch=super().poll(now).batch, expired=tuple(dropped))


def _cumulative(values: Iterable[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def without_noise(scenario: Scenario) -> Scenario:
    """The same scenario with every batch taking exactly its mean."""
    phases = tuple(replace(phase, cost=replace(phase.cost, noise=0.0)) for phase in scenario.phases)
    return replace(scenario, name=f"{scenario.name} (no noise)", phases=phases)


def known_line(scenario: Scenario, reserve: float, seed: int | None = None) -> Result:
    """`KnownLinePolicy` at `reserve` sigmas on the scenario's arrivals for `seed`: over
    `RESERVES`, the frontier `benchmarks.targets` holds a short limit's goodput to."""
    return simulate(scenario, f"known line, reserve {reserve:g} sigma", seed=seed,
                    policy=KnownLinePolicy(scenario, reserve))


def _late(run: Result) -> float:
    return run.late / run.requests if run.requests else 0.0


def _false(run: Result) -> float:
    return run.false_rejections / run.requests if run.requests else 0.0


def _row(label: str, run: Result, bento: Result) -> str:
    ratio = run.goodput_rps / bento.goodput_rps if bento.goodput_rps else 1.0
    return (f"| {label} | {run.goodput_rps:.1f} | {ratio:.3f} | {100 * _late(run):.3f} | "
            f"{100 * _false(run):.2f} | {run.reject_wait_p99_ms:.1f} |")


def rules(scenario: Scenario, within: float) -> dict[str, Callable[[float], Policy]]:
    """The rules a frontier is drawn for, by name, each made for a reserve in sigmas;
    `within` is the share of the limit a decision may wait."""
    horizon_s = within * scenario.slo_ms / 1000.0
    return {
        "known line": lambda r: KnownLinePolicy(scenario, r),
        f"decided within {within:.0%} of the limit":
            lambda r: DecideLaterPolicy(scenario, r, horizon_s),
        "dropping the oldest": lambda r: DropOldestPolicy(scenario, r),
    }


def frontier(
    scenario: Scenario, reserves: tuple[float, ...], seed: int, within: float = DECIDE_WITHIN
) -> list[str]:
    """A markdown table: BentoML, adaptive, and each rule on the known line at each reserve,
    with the best goodput each rule reaches within each late bound of the targets."""
    bento = simulate(scenario, "bentoml", seed=seed)
    adaptive = simulate(scenario, "adaptive", seed=seed)
    out = [f"{scenario.name}, seed {seed}:", "",
           "| policy | goodput req/s | of BentoML's | late % | false refusals % | "
           "refusal wait p99 ms |",
           "|---|---|---|---|---|---|",
           _row("BentoML", bento, bento), _row("adaptive", adaptive, bento)]
    bests = []
    for name, make in rules(scenario, within).items():
        runs = [(r, simulate(scenario, name, seed=seed, policy=make(r))) for r in reserves]
        out += [_row(f"{name}, reserve {r:g} sigma", run, bento) for r, run in runs]
        for bound_name, bound in (("0.1%", LATE_FLOOR),
                                  ("BentoML's", max(LATE_FLOOR, _late(bento)))):
            kept = [run for _, run in runs if _late(run) <= bound]
            best = max(kept, key=lambda run: run.goodput_rps, default=None)
            head = f"best {name} goodput with late <= {bound_name} ({100 * bound:.3f}%): "
            if best is None:
                bests.append(head + "none within it")
                continue
            bests.append(head + f"{best.goodput_rps:.1f} req/s, "
                         f"{best.goodput_rps / bento.goodput_rps:.3f} of BentoML's, false "
                         f"refusals {100 * _false(best):.2f}%, refusal wait p99 "
                         f"{best.reject_wait_p99_ms:.1f} ms")
    return out + [""] + bests + [""]


def variants() -> list[Scenario]:
    """Every bundled scenario as it is and without noise (a replay has no noise to take
    away), in name order."""
    out = []
    for path in sorted(SCENARIOS.glob("*.yml")):
        scenario = load_scenario(path)
        out.append(scenario)
        if any(phase.cost.noise > 0.0 for phase in scenario.phases):
            out.append(without_noise(scenario))
    return out


def _best(runs: Iterable[Result], bound: float) -> Result | None:
    kept = [run for run in runs if _late(run) <= bound]
    return max(kept, key=lambda run: run.goodput_rps, default=None)


def summary_row(scenario: Scenario, seed: int) -> str:
    """One row of `summary`: the adaptive policy and BentoML's rule, and the best goodput of
    the known line within 0.1% late, within the adaptive policy's own lateness (the target's
    frontier, `benchmarks.targets`) and within BentoML's."""
    adaptive = simulate(scenario, "adaptive", seed=seed)
    bento = simulate(scenario, "bentoml", seed=seed)
    head = (f"| {scenario.name} | {100 * _late(adaptive):.3f} | {adaptive.goodput_rps:.1f} | "
            f"{100 * _late(bento):.3f} | {bento.goodput_rps:.1f} |")
    if any(phase.cost.inflated for phase in scenario.phases):
        return head + " no frontier | | | |"
    runs = [known_line(scenario, r, seed) for r in RESERVES]
    cells = []
    for bound in (LATE_FLOOR, max(LATE_FLOOR, _late(adaptive)), max(LATE_FLOOR, _late(bento))):
        best = _best(runs, bound)
        cells.append("-" if best is None or not best.goodput_rps
                     else f"{adaptive.goodput_rps / best.goodput_rps:.3f}")
    floor = _best(runs, LATE_FLOOR)
    known = "-" if floor is None else f"{floor.goodput_rps:.1f} ({100 * _late(floor):.3f})"
    return head + f" {known} | " + " | ".join(cells) + " |"


def summary(seed: int = 1, workers: int = WORKERS) -> str:
    """Every bundled scenario, with and without noise: the adaptive policy (refusing at
    arrival) beside BentoML's rule and the known-line frontier, on the same arrivals."""
    chosen = variants()
    with ProcessPoolExecutor(workers) as pool:
        rows = list(pool.map(summary_row, chosen, [seed] * len(chosen)))
    return "\n".join([
        f"Seed {seed}; known line: `KnownLinePolicy` at reserves "
        + ", ".join(f"{r:g}" for r in RESERVES) + " sigmas, its best goodput within each "
        "lateness; the last three columns are the adaptive policy's goodput over that best.",
        "",
        "| scenario | adaptive late % | adaptive goodput req/s | BentoML late % "
        "| BentoML goodput req/s | known line within 0.1% late: goodput (late %) "
        "| adaptive / known line, within 0.1% | ... within max(0.1%, adaptive's) "
        "| ... within max(0.1%, BentoML's) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.at_arrival_bound",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", default=list(DEFAULT_SCENARIOS),
                        help="names in benchmarks/scenarios/ or paths to scenario YAML files")
    parser.add_argument("--reserves", default=",".join(f"{r:g}" for r in RESERVES),
                        help="reserves in sigmas of the known noise, comma-separated")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--decide-within", type=float, default=DECIDE_WITHIN,
                        help="the share of the limit a deferred decision may wait "
                             f"(default {DECIDE_WITHIN:g}, the refusal-wait target; 1 settles "
                             "each request when the batch running at its arrival ends)")
    parser.add_argument("--doc", type=Path,
                        help="write the summary of every bundled scenario, with and without "
                             f"noise, between {DOC_START!r} and {DOC_END!r} of this file")
    parser.add_argument("--workers", type=int, default=WORKERS,
                        help="processes for --doc (default 2)")
    args = parser.parse_args(argv)
    if args.doc is not None:
        table = summary(args.seed, args.workers)
        print(table)
        replace_block(args.doc, table, DOC_START, DOC_END)
        return 0
    reserves = tuple(float(part) for part in args.reserves.split(","))
    for name in args.scenarios:
        path = Path(name) if name.endswith((".yml", ".yaml")) else SCENARIOS / f"{name}.yml"
        scenario = load_scenario(path)
        try:
            for variant in (scenario, without_noise(scenario)):
                print("\n".join(frontier(variant, reserves, args.seed, args.decide_within)))
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
