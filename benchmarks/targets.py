"""The targets of the adaptive policy against BentoML's rule on the same traffic:

- goodput at least 0.99 times BentoML's;
- late at most the larger of 0.1% of requests and BentoML's late share;
- refusals answered within 10% of the latency limit at p99 (refusal wait p99 <= 0.1 * limit);
- false refusals below 1% of requests (reported beside BentoML's).

Each check is a `Verdict` carrying its numbers and an `excess`: how far past its bound the value
is, in the target's own unit (positive is a miss), so the worst case over many runs is the
largest excess.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from batchserve.runner.sim.simulate import Result

TARGETS = ("goodput", "late", "refusal wait", "false refusals")
GOODPUT_SHARE = 0.99
LATE_FLOOR = 0.001
WAIT_SHARE = 0.1
FALSE_SHARE = 0.01


class Verdict(NamedTuple):
    target: str
    ok: bool
    excess: float
    text: str


def _share(count: int, run: Result) -> float:
    return count / run.requests if run.requests else 0.0


def verdicts(ours: Result, bento: Result, slo_ms: float) -> list[Verdict]:
    """One verdict per target in `TARGETS` order."""
    floor = GOODPUT_SHARE * bento.goodput_rps
    ratio = ours.goodput_rps / bento.goodput_rps if bento.goodput_rps > 0 else 1.0
    late, bento_late = _share(ours.late, ours), _share(bento.late, bento)
    late_bound = max(LATE_FLOOR, bento_late)
    wait_bound = WAIT_SHARE * slo_ms
    false, bento_false = _share(ours.false_rejections, ours), _share(bento.false_rejections, bento)
    return [
        Verdict("goodput", ours.goodput_rps >= floor, GOODPUT_SHARE - ratio,
                f"goodput {ours.goodput_rps:.1f} vs bentoml {bento.goodput_rps:.1f} "
                f"(ratio {ratio:.4f}, at least {GOODPUT_SHARE})"),
        Verdict("late", late <= late_bound, 100.0 * (late - late_bound),
                f"late {ours.late}/{ours.requests} = {100 * late:.3f}% vs bound "
                f"{100 * late_bound:.3f}% (bentoml {100 * bento_late:.3f}%)"),
        Verdict("refusal wait", ours.reject_wait_p99_ms <= wait_bound,
                (ours.reject_wait_p99_ms - wait_bound) / slo_ms,
                f"refusal wait p99 {ours.reject_wait_p99_ms:.2f} ms vs bound {wait_bound:.2f} ms "
                f"(bentoml {bento.reject_wait_p99_ms:.2f} ms)"),
        Verdict("false refusals", false < FALSE_SHARE, 100.0 * (false - FALSE_SHARE),
                f"false refusals {ours.false_rejections}/{ours.requests} = {100 * false:.3f}% "
                f"vs bound {100 * FALSE_SHARE:g}% (bentoml {bento.false_rejections} = "
                f"{100 * bento_false:.3f}%)"),
    ]


def lines(name: str, found: Sequence[Verdict]) -> list[str]:
    return [f"- {'PASS' if v.ok else 'MISS'}: {name}: {v.text}" for v in found]
