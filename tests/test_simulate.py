"""The simulator: scenario files, bookkeeping, the command line (each test runs in a second)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.policy import Batch, Request
from runner.scenario import ScenarioError, load_scenario, parse_scenario
from runner.simulate import (
    _answered,
    _Trace,
    arrivals,
    false_rejections,
    grid_search,
    main,
    simulate,
)

SCENARIOS = Path(__file__).parent.parent / "benchmarks" / "scenarios"
SMALL = {
    "slo_ms": 100,
    "max_batch_size": 64,
    "seed": 3,
    "cost": {"intercept_ms": 5, "per_item_ms": 0.5, "noise": 0.05},
    "request_size": {"min": 1, "max": 4},
    "phases": [{"seconds": 2, "rate": 300}, {"seconds": 3, "rate": 3000}],
}
KEYS = {"requests", "ok", "rejected", "late", "goodput_rps", "p50_ms", "p99_ms",
        "mean_batch_size", "false_rejections"}


def test_every_policy_meets_the_same_requests_and_accounts_for_each() -> None:
    scenario = parse_scenario(SMALL, "small")
    counts = set()
    for kind in ("adaptive", "fixed", "none", "bentoml"):
        result = simulate(scenario, kind)
        assert result.requests == result.ok + result.rejected
        assert result.late <= result.ok
        assert result.goodput_rps == pytest.approx((result.ok - result.late) / 5.0)
        counts.add(result.requests)
    assert counts == {len(arrivals(scenario, 3))}


def test_adaptive_refuses_at_arrival_and_is_rarely_late_in_overload() -> None:
    result = simulate(parse_scenario(SMALL, "small"), "adaptive")
    assert result.rejected > 0
    assert result.rejected_at_arrival == result.rejected
    assert result.late <= 0.01 * result.ok


def test_a_phase_cost_overrides_from_its_start_on() -> None:
    data = dict(SMALL, phases=[
        {"seconds": 1, "rate": 10},
        {"seconds": 1, "rate": 10, "cost": {"intercept_ms": 10}},
        {"seconds": 1, "rate": 10},
    ])
    phases = parse_scenario(data).phases
    assert [phase.cost.intercept_ms for phase in phases] == [5, 10, 10]
    assert phases[2].cost.per_item_ms == 0.5 and phases[2].cost.noise == 0.05


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slo_ms": -5}, r"^small\.slo_ms has value -5; it must be a number greater than 0$"),
        ({"phases": []}, r"^small\.phases has value \[\]; it must be a non-empty list$"),
        ({"colour": 1}, r"^small has unknown key 'colour'"),
        ({"phases": [{"seconds": 1, "rate": "x"}]}, r"^small\.phases\[0\]\.rate has value 'x'"),
        ({"cost": {"intercept_ms": 5}}, r"^small\.cost\.per_item_ms is missing"),
        ({"request_size": 99}, r"^small\.request_size has maximum 99; it must not exceed"),
    ],
)
def test_scenario_errors_name_the_dotted_key(change: dict[str, object], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(dict(SMALL, **change), "small")


def _batch(trace: _Trace, start: float, finish: float, rows: int, slack: float) -> None:
    trace.batch_starts.append(start)
    trace.batch_info.append((finish, rows, 0.0005))
    trace.batch_slack.append(slack)


def test_false_rejection_means_a_batch_with_room_finished_in_time() -> None:
    trace = _Trace()
    refused = Request(1, 1, 0.0, 0.1)
    trace.refusals.append((refused, 0.0))
    _batch(trace, 0.01, 0.05, 64, 0.05)  # full: no room
    assert false_rejections(trace, 64) == 0
    _batch(trace, 0.05, 0.0998, 10, 0.05)  # room, but 0.0998 + 0.0005 > 0.1
    assert false_rejections(trace, 64) == 0
    _batch(trace, 0.1, 0.11, 10, 0.05)  # room, but it starts at the deadline
    assert false_rejections(trace, 64) == 0
    early = _Trace()
    early.refusals.append((refused, 0.0))
    _batch(early, 0.06, 0.09, 10, 0.05)
    assert false_rejections(early, 64) == 1


def test_a_refusal_is_not_false_if_serving_it_makes_another_answer_late() -> None:
    trace = _Trace()
    trace.refusals.append((Request(1, 2, 0.0, 0.1), 0.0))
    _batch(trace, 0.01, 0.05, 10, 0.0004)  # its own answers have 0.4 ms to spare: 1 ms is late
    assert false_rejections(trace, 64) == 0
    trace.batch_slack[0] = 0.05
    _batch(trace, 0.05, 0.08, 10, 0.0002)  # back to back: the 1 ms slip reaches it in full
    assert false_rejections(trace, 64) == 0
    trace.batch_starts[1] = 0.0509  # 0.9 ms idle gap absorbs all but 0.1 ms of the slip
    assert false_rejections(trace, 64) == 1


def test_slack_counts_only_answers_that_were_on_time() -> None:
    trace = _Trace()
    late, on_time = Request(1, 1, 0.0, 0.04), Request(2, 1, 0.0, 0.06)
    trace.batch_starts.append(0.0)
    trace.batch_info.append((0.05, 2, 0.0005))
    _answered(trace, Batch((late, on_time), "idle"), 0.05)
    assert trace.late == 1
    assert trace.batch_slack == [pytest.approx(0.01)]


def test_grid_search_puts_the_best_goodput_first() -> None:
    scenario = parse_scenario(SMALL, "small")
    runs = grid_search(scenario, windows_ms=(0.0, 20.0), caps=(4, 64))
    assert len(runs) == 4
    assert runs[0][2].goodput_rps == max(run[2].goodput_rps for run in runs)


def test_command_line_prints_one_json_object(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    path = tmp_path / "small.yml"
    path.write_text(json.dumps(SMALL))  # JSON is YAML
    assert main([str(path), "--policy", "fixed", "--window-ms", "2", "--cap", "16",
                 "--seed", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= set(out)
    assert out["policy"] == "fixed"


def test_command_line_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "bad.yml"
    path.write_text("cost: {intercept_ms: 5, per_item_ms: 0.5}\nphases: []\n")
    assert main([str(path)]) == 2
    assert capsys.readouterr().err == (
        "batchserve simulate: error: bad.phases has value []; it must be a non-empty list\n"
    )
    with pytest.raises(SystemExit):
        main([str(path), "--policy", "adaptive", "--cap", "8"])


def test_shipped_scenarios_load() -> None:
    names = {path.stem for path in SCENARIOS.glob("*.yml")}
    assert {"low_load", "load_80", "overload_150", "steps", "bursts", "cost_doubling"} <= names
    for path in SCENARIOS.glob("*.yml"):
        assert load_scenario(path).seconds > 0


def test_batch_reasons_are_recorded() -> None:
    result = simulate(parse_scenario(SMALL, "small"), "adaptive")
    assert sum(result.reasons.values()) == result.batches
    assert set(result.reasons) <= {"idle", "full", "deadline", "window", "cap"}
    assert Batch((Request(1, 2, 0.0, 1.0),), "idle").rows == 2
