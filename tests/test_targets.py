"""The verdicts of `benchmarks.targets` on made-up results: each bound, which goodput target a
limit gets, and how the known-line frontier is read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from batchserve.runner.sim.scenario import Cost, Phase, Scenario, Stalls, load_scenario
from batchserve.runner.sim.simulate import Result
from benchmarks.targets import (
    TARGETS,
    Verdict,
    batch_time_at_cap_s,
    frontier_point,
    limit_in_batches,
    lines,
    long_limit,
    needs_frontier,
    verdicts,
)

SCENARIOS = Path(__file__).parent.parent / "benchmarks" / "scenarios"
LINE = Cost(5.0, 0.5, 0.05)  # a full batch of 10 rows takes 10 ms


def scenario(slo_ms: float, cost: Cost = LINE) -> Scenario:
    return Scenario("s", slo_ms, 10, 1, 1, 1, (Phase(10.0, 100.0, cost),))


def result(goodput: float = 100.0, late: int = 0, wait_ms: float = 0.0, false: int = 0,
           policy: str = "adaptive") -> Result:
    return Result(scenario="s", policy=policy, seconds=10.0, requests=10_000, ok=9_000,
                  rejected=1_000, late=late, goodput_rps=goodput, p50_ms=1.0, p99_ms=2.0,
                  mean_batch_size=4.0, false_rejections=false, rejected_at_arrival=1_000,
                  reject_wait_p99_ms=wait_ms, batches=100)


def by_target(found: list[Verdict]) -> dict[str, Verdict]:
    return {verdict.target: verdict for verdict in found}


def test_the_limit_counts_in_full_batch_times_on_the_first_phase() -> None:
    later = Phase(10.0, 100.0, Cost(50.0, 5.0))
    assert batch_time_at_cap_s(scenario(40.0)) == pytest.approx(0.010)
    assert limit_in_batches(
        Scenario("s", 40.0, 10, 1, 1, 1, (Phase(1.0, 1.0, LINE), later))) == pytest.approx(4.0)
    assert long_limit(scenario(40.0))
    assert long_limit(scenario(40.0 * (1 - 1e-9)))  # a hair short by floating point
    assert not long_limit(scenario(39.9))


def test_a_replayed_cost_counts_its_recordings_line() -> None:
    replay = load_scenario(SCENARIOS / "replay_mlp.yml")
    recording = replay.phases[0].cost.replay
    assert recording is not None
    assert batch_time_at_cap_s(replay) == recording.line(replay.max_batch_size)


def test_at_arrival_on_a_long_limit_is_held_to_bentoml() -> None:
    long = scenario(40.0)
    bento = result(100.0, late=5, wait_ms=20.0, false=3, policy="bentoml")
    found = by_target(verdicts("at_arrival", result(99.0, late=5, wait_ms=4.0, false=99),
                               bento, long))
    assert list(found) == list(TARGETS["at_arrival"])
    assert all(v.ok and v.judged for v in found.values())
    assert found["goodput"].text == "goodput 99.0 vs bentoml 100.0 (ratio 0.9900, at least 0.99)"
    missed = by_target(verdicts("at_arrival", result(98.9, late=11, wait_ms=4.1, false=100),
                                bento, long))
    assert not any(v.ok for v in missed.values())
    assert missed["goodput"].excess == pytest.approx(0.001)
    assert missed["late"].excess == pytest.approx(0.01)  # 0.11% against the 0.1% floor
    assert missed["refusal wait"].excess == pytest.approx(0.1 / 40.0)
    assert missed["false refusals"].text.startswith("false refusals 100/10000 = 1.000% vs")


def test_the_late_bound_is_bentomls_share_when_larger() -> None:
    bento = result(late=50, policy="bentoml")  # 0.5%
    assert by_target(verdicts("at_arrival", result(late=50), bento, scenario(40.0)))["late"].ok
    assert not by_target(verdicts("at_arrival", result(late=51), bento,
                                  scenario(40.0)))["late"].ok


def test_a_short_limit_is_held_to_the_best_known_line_run_the_late_target_allows() -> None:
    short = scenario(25.0)
    assert needs_frontier(short)
    frontier = [result(120.0, late=30), result(103.0, late=10), result(101.0, late=0)]
    bento = result(200.0, policy="bentoml")
    goodput = verdicts("at_arrival", result(100.0, late=10), bento, short, frontier)[0]
    assert goodput.ok  # 100 against 103: 0.971; BentoML's 200 does not count here
    assert goodput.excess == pytest.approx(0.97 - 100.0 / 103.0)
    assert "known-line frontier 103.0 at 0.100% late" in goodput.text
    # Being more punctual than the late target asks buys no lower bar: 99 against 103.
    punctual = verdicts("at_arrival", result(99.0, late=0), bento, short, frontier)[0]
    assert not punctual.ok
    assert "known-line frontier 103.0 at 0.100% late" in punctual.text
    # BentoML's own lateness, when larger, is what the late target allows: 99 against 120.
    late_bento = result(200.0, late=30, policy="bentoml")
    assert "frontier 120.0 at 0.300% late" in verdicts(
        "at_arrival", result(99.0, late=0), late_bento, short, frontier)[0].text


def test_the_frontier_point_is_the_best_goodput_within_the_lateness() -> None:
    runs = [result(120.0, late=30), result(103.0, late=10), result(101.0, late=0)]
    assert frontier_point(runs, 0.001) is runs[1]
    assert frontier_point(runs, 0.0) is runs[2]
    assert frontier_point(runs[:2], 0.0) is None


def test_no_known_line_run_as_punctual_leaves_goodput_unjudged() -> None:
    found = verdicts("at_arrival", result(50.0, late=0), result(policy="bentoml"),
                     scenario(25.0), [result(120.0, late=30)])
    goodput = found[0]
    assert (goodput.judged, goodput.mark, goodput.excess) == (False, "n/a", -math.inf)
    assert "no known-line run late at most 0.100% (the least late 0.300%)" in goodput.text


def test_a_short_limit_without_a_plain_line_has_no_frontier() -> None:
    stalled = scenario(25.0, Cost(5.0, 0.5, 0.05, stalls=Stalls(0.01, 100.0)))
    assert not needs_frontier(stalled)
    goodput = verdicts("at_arrival", result(10.0), result(policy="bentoml"), stalled)[0]
    assert not goodput.judged
    assert "no frontier (the limit is 2.50 batch times at the cap" in goodput.text
    assert lines("s", [goodput])[0].startswith("- n/a: s: goodput 10.0, no frontier")
    assert json.loads(json.dumps(goodput.to_json()))["excess"] is None


def test_a_short_limit_on_a_plain_line_needs_its_frontier() -> None:
    with pytest.raises(ValueError, match=r"^s: the limit is 2\.50 batch times at the cap; its "
                                         r"goodput needs the known-line runs$"):
        verdicts("at_arrival", result(), result(policy="bentoml"), scenario(25.0))


def test_refusing_the_oldest_is_held_to_bentoml_on_every_limit() -> None:
    short = scenario(25.0)  # no frontier needed: the oldest mode is held to BentoML anywhere
    bento = result(100.0, late=20, wait_ms=12.0, policy="bentoml")
    found = by_target(verdicts("oldest", result(99.0, late=20, wait_ms=12.0), bento, short))
    assert list(found) == list(TARGETS["oldest"])
    assert all(v.ok for v in found.values())
    wait = by_target(verdicts("oldest", result(99.0, late=20, wait_ms=12.5), bento,
                              short))["refusal wait"]
    assert not wait.ok
    assert wait.excess == pytest.approx(0.5 / 25.0)
    assert wait.text == "refusal wait p99 12.50 ms vs bound 12.00 ms (bentoml 12.00 ms)"
    assert lines("tight", [wait]) == [f"- MISS: tight: {wait.text}"]
