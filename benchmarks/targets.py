"""The targets of the adaptive policy's two refusal modes, each judged against BentoML's rule
on the same arrivals.

Refusing at arrival (`refuse="at_arrival"`, the default):

- refusal wait p99 at most 10% of the limit;
- late at most the larger of 0.1% of requests and BentoML's late share;
- false refusals below 1% of requests (reported beside BentoML's);
- goodput at least 0.99 times BentoML's where the limit is at least 4 batch times at the cap
  (the mean time of a batch of `max_batch_size` rows on the first phase's cost). On a shorter
  limit a decision at arrival cannot reach BentoML's goodput even on the true cost
  (docs/dispatcher.md, "What a decision at arrival can reach"), so goodput is held instead to
  0.97 times the known-line frontier: the best goodput `KnownLinePolicy` reaches over its
  reserves among its runs late at most what the late target allows (the larger of 0.1% and
  BentoML's share; `benchmarks.at_arrival_bound`). Only a plain cost line has a frontier;
  elsewhere that target is not judged ("no frontier").

Refusing the oldest (`refuse="oldest"`):

- goodput at least 0.99 times BentoML's;
- late at most the larger of 0.1% of requests and BentoML's late share;
- refusal wait p99 at most BentoML's.

Each check is a `Verdict` carrying its numbers and an `excess`: how far past its bound the value
is, in the target's own unit (positive is a miss), so the worst case over many runs is the
largest excess.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from batchserve.runner.core.config import REFUSE_MODES, Refuse
from batchserve.runner.sim.scenario import Scenario
from batchserve.runner.sim.simulate import Result, label

Mode = Refuse
MODES: tuple[Mode, ...] = REFUSE_MODES
TARGETS: dict[Mode, tuple[str, ...]] = {
    "at_arrival": ("goodput", "late", "refusal wait", "false refusals"),
    "oldest": ("goodput", "late", "refusal wait"),
}
TITLES: dict[Mode, str] = {
    "at_arrival": f"{label('adaptive', {})}, refusing at arrival (the default)",
    "oldest": f"{label('adaptive', {'refuse': 'oldest'})}, refusing the oldest",
}
GOODPUT_SHARE = 0.99
FRONTIER_SHARE = 0.97
LONG_LIMIT_BATCHES = 4.0
LIMIT_TOLERANCE = 1e-6
"""A relative tolerance on the limit in batch times: the grid's limits are exactly 4 batch
times, which floating point may put a hair below."""
LATE_FLOOR = 0.001
WAIT_SHARE = 0.1
FALSE_SHARE = 0.01


class Verdict(NamedTuple):
    target: str
    ok: bool
    excess: float
    text: str
    judged: bool = True

    @property
    def mark(self) -> str:
        return "n/a" if not self.judged else "PASS" if self.ok else "MISS"

    def to_json(self) -> dict[str, Any]:
        """Every field, with an unjudged verdict's infinite excess as null (JSON has no
        infinity)."""
        return {**self._asdict(), "excess": self.excess if math.isfinite(self.excess) else None}


def batch_time_at_cap_s(scenario: Scenario) -> float:
    """The mean time of a full batch on the first phase's cost: its line (for a replay, the
    recording's CPU line) at `max_batch_size` rows."""
    cost, rows = scenario.phases[0].cost, scenario.max_batch_size
    return cost.replay.line(rows) if cost.replay is not None else cost.mean_s(rows)


def limit_in_batches(scenario: Scenario) -> float:
    return scenario.slo_ms / 1000.0 / batch_time_at_cap_s(scenario)


def long_limit(scenario: Scenario) -> bool:
    """Whether goodput is held to BentoML's (the limit is at least 4 batch times at the cap)."""
    return limit_in_batches(scenario) >= LONG_LIMIT_BATCHES * (1.0 - LIMIT_TOLERANCE)


def plain_line(scenario: Scenario) -> bool:
    """Whether every phase's cost is a plain line with lognormal noise, as `KnownLinePolicy`
    needs: no replay, contention, tail or stalls."""
    return not any(phase.cost.inflated for phase in scenario.phases)


def needs_frontier(scenario: Scenario) -> bool:
    """Whether the at-arrival goodput target is judged against the known-line frontier."""
    return not long_limit(scenario) and plain_line(scenario)


def share(count: int, run: Result) -> float:
    return count / run.requests if run.requests else 0.0


def late_share(run: Result) -> float:
    return share(run.late, run)


def frontier_point(frontier: Sequence[Result], late: float) -> Result | None:
    """The frontier's run with the best goodput among those late at most `late`."""
    kept = [run for run in frontier if late_share(run) <= late]
    return max(kept, key=lambda run: run.goodput_rps, default=None)


def _ratio(ours: Result, other: Result) -> float:
    return ours.goodput_rps / other.goodput_rps if other.goodput_rps > 0 else 1.0


def _goodput_vs_bento(ours: Result, bento: Result) -> Verdict:
    ratio = _ratio(ours, bento)
    return Verdict("goodput", ratio >= GOODPUT_SHARE, GOODPUT_SHARE - ratio,
                   f"goodput {ours.goodput_rps:.1f} vs bentoml {bento.goodput_rps:.1f} "
                   f"(ratio {ratio:.4f}, at least {GOODPUT_SHARE})")


def _goodput_vs_frontier(
    ours: Result, bento: Result, scenario: Scenario, frontier: Sequence[Result]
) -> Verdict:
    short = f"the limit is {limit_in_batches(scenario):.2f} batch times at the cap"
    if not plain_line(scenario):
        return Verdict("goodput", True, -math.inf,
                       f"goodput {ours.goodput_rps:.1f}, no frontier ({short}, the cost is "
                       f"not a plain line; bentoml {bento.goodput_rps:.1f}, ratio "
                       f"{_ratio(ours, bento):.4f})", judged=False)
    if not frontier:
        raise ValueError(f"{scenario.name}: {short}; its goodput needs the known-line runs")
    late = max(LATE_FLOOR, late_share(bento))  # what the late target allows
    best = frontier_point(frontier, late)
    if best is None:
        least = min(late_share(run) for run in frontier)
        return Verdict("goodput", True, -math.inf,
                       f"goodput {ours.goodput_rps:.1f}, no known-line run late at most "
                       f"{100 * late:.3f}% (the least late {100 * least:.3f}%)", judged=False)
    ratio = _ratio(ours, best)
    return Verdict("goodput", ratio >= FRONTIER_SHARE, FRONTIER_SHARE - ratio,
                   f"goodput {ours.goodput_rps:.1f} vs known-line frontier "
                   f"{best.goodput_rps:.1f} at {100 * late_share(best):.3f}% late ({short}; "
                   f"ratio {ratio:.4f}, at least {FRONTIER_SHARE}; bentoml "
                   f"{bento.goodput_rps:.1f})")


def _late(ours: Result, bento: Result) -> Verdict:
    late, bento_late = late_share(ours), late_share(bento)
    bound = max(LATE_FLOOR, bento_late)
    return Verdict("late", late <= bound, 100.0 * (late - bound),
                   f"late {ours.late}/{ours.requests} = {100 * late:.3f}% vs bound "
                   f"{100 * bound:.3f}% (bentoml {100 * bento_late:.3f}%)")


def _wait(ours: Result, bento: Result, bound_ms: float, slo_ms: float) -> Verdict:
    wait = ours.reject_wait_p99_ms
    return Verdict("refusal wait", wait <= bound_ms, (wait - bound_ms) / slo_ms,
                   f"refusal wait p99 {wait:.2f} ms vs bound {bound_ms:.2f} ms "
                   f"(bentoml {bento.reject_wait_p99_ms:.2f} ms)")


def _false(ours: Result, bento: Result) -> Verdict:
    false = share(ours.false_rejections, ours)
    return Verdict("false refusals", false < FALSE_SHARE, 100.0 * (false - FALSE_SHARE),
                   f"false refusals {ours.false_rejections}/{ours.requests} = "
                   f"{100 * false:.3f}% vs bound {100 * FALSE_SHARE:g}% (bentoml "
                   f"{bento.false_rejections} = {100 * share(bento.false_rejections, bento):.3f}%)")


def at_arrival(
    ours: Result, bento: Result, scenario: Scenario, frontier: Sequence[Result] = ()
) -> list[Verdict]:
    """The targets of refusing at arrival, in `TARGETS["at_arrival"]` order; `frontier` holds
    the known-line runs on the same arrivals, needed where `needs_frontier(scenario)`."""
    goodput = (_goodput_vs_bento(ours, bento) if long_limit(scenario)
               else _goodput_vs_frontier(ours, bento, scenario, frontier))
    return [goodput, _late(ours, bento),
            _wait(ours, bento, WAIT_SHARE * scenario.slo_ms, scenario.slo_ms),
            _false(ours, bento)]


def oldest(
    ours: Result, bento: Result, scenario: Scenario, frontier: Sequence[Result] = ()
) -> list[Verdict]:
    """The targets of refusing the oldest, in `TARGETS["oldest"]` order."""
    return [_goodput_vs_bento(ours, bento), _late(ours, bento),
            _wait(ours, bento, bento.reject_wait_p99_ms, scenario.slo_ms)]


JUDGES: dict[Mode, Callable[[Result, Result, Scenario, Sequence[Result]], list[Verdict]]] = {
    "at_arrival": at_arrival,
    "oldest": oldest,
}


def verdicts(
    mode: Mode, ours: Result, bento: Result, scenario: Scenario,
    frontier: Sequence[Result] = (),
) -> list[Verdict]:
    """One verdict per target of `mode`, in `TARGETS[mode]` order."""
    return JUDGES[mode](ours, bento, scenario, frontier)


def lines(name: str, found: Sequence[Verdict]) -> list[str]:
    return [f"- {v.mark}: {name}: {v.text}" for v in found]
