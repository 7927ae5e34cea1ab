"""The simulator: scenario files, bookkeeping, the command line (each test runs in a second)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from batchserve.runner.policy.base import Batch, Request, Step
from batchserve.runner.policy.policies import make_policy
from batchserve.runner.sim.batch_times import BatchTimer
from batchserve.runner.sim.recording import load_recording
from batchserve.runner.sim.scenario import (
    Contention,
    Cost,
    ScenarioError,
    Stalls,
    Tail,
    load_scenario,
    parse_scenario,
)
from batchserve.runner.sim.simulate import false_rejections, grid_search, main, simulate
from batchserve.runner.sim.trace import Trace, arrivals, batch_answered
from benchmarks.dispatcher_table import one_request_ms

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


def _batch(trace: Trace, start: float, finish: float, rows: int, slack: float) -> None:
    trace.batch_starts.append(start)
    trace.batch_info.append((finish, rows, 0.0005))
    trace.batch_slack.append(slack)


def test_false_rejection_means_a_batch_with_room_finished_in_time() -> None:
    trace = Trace()
    refused = Request(1, 1, 0.0, 0.1)
    trace.refusals.append((refused, 0.0))
    _batch(trace, 0.01, 0.05, 64, 0.05)  # full: no room
    assert false_rejections(trace, 64) == 0
    _batch(trace, 0.05, 0.0998, 10, 0.05)  # room, but 0.0998 + 0.0005 > 0.1
    assert false_rejections(trace, 64) == 0
    _batch(trace, 0.1, 0.11, 10, 0.05)  # room, but it starts at the deadline
    assert false_rejections(trace, 64) == 0
    early = Trace()
    early.refusals.append((refused, 0.0))
    _batch(early, 0.06, 0.09, 10, 0.05)
    assert false_rejections(early, 64) == 1


def test_a_refusal_is_not_false_if_serving_it_makes_another_answer_late() -> None:
    trace = Trace()
    trace.refusals.append((Request(1, 2, 0.0, 0.1), 0.0))
    _batch(trace, 0.01, 0.05, 10, 0.0004)  # its own answers have 0.4 ms to spare: 1 ms is late
    assert false_rejections(trace, 64) == 0
    trace.batch_slack[0] = 0.05
    _batch(trace, 0.05, 0.08, 10, 0.0002)  # back to back: the 1 ms slip reaches it in full
    assert false_rejections(trace, 64) == 0
    trace.batch_starts[1] = 0.0509  # 0.9 ms idle gap absorbs all but 0.1 ms of the slip
    assert false_rejections(trace, 64) == 1


def test_refusals_count_false_together_not_each_alone() -> None:
    # Back-to-back batches with 0.8 ms to spare each: one more row (0.5 ms) fits, and with
    # it in, the 0.3 ms left takes no second. Judged alone, both would count.
    trace = Trace()
    for index in (1, 2):
        trace.refusals.append((Request(index, 1, 0.0, 0.1), 0.0))
    _batch(trace, 0.01, 0.05, 10, 0.0008)
    _batch(trace, 0.05, 0.09, 10, 0.0008)
    assert false_rejections(trace, 64) == 1
    trace.batch_starts[1] = 0.051  # a 1 ms idle gap: the second batch keeps its 0.8 ms
    assert false_rejections(trace, 64) == 2


def test_slack_counts_only_answers_that_were_on_time() -> None:
    trace = Trace()
    late, on_time = Request(1, 1, 0.0, 0.04), Request(2, 1, 0.0, 0.06)
    trace.batch_starts.append(0.0)
    trace.batch_info.append((0.05, 2, 0.0005))
    batch_answered(trace, Batch((late, on_time), "idle"), 0.05)
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


def test_the_results_table_reads_one_requests_time_from_the_scenario() -> None:
    """The low-load check compares p50 with this: it follows the scenario file's cost."""
    assert one_request_ms(parse_scenario(SMALL)) == pytest.approx(5.5)  # 5 + 0.5 * 1 row
    bigger = {**SMALL, "cost": {"intercept_ms": 8, "per_item_ms": 2},
              "request_size": {"min": 3, "max": 4}}
    assert one_request_ms(parse_scenario(bigger)) == pytest.approx(14.0)  # 8 + 2 * 3 rows


def test_batch_reasons_are_recorded() -> None:
    result = simulate(parse_scenario(SMALL, "small"), "adaptive")
    assert sum(result.reasons.values()) == result.batches
    assert set(result.reasons) <= {"idle", "full", "deadline", "window", "cap"}
    assert Batch((Request(1, 2, 0.0, 1.0),), "idle").rows == 2


# --- a shared machine: contention, tail, stalls, replay ------------------------------------


class Spy:
    """A policy (one request per batch by default) that records what `complete` was told."""

    def __init__(self, kind: str = "none") -> None:
        self.inner = make_policy(kind, 64, 0.1)
        self.completed: list[tuple[int, float, float]] = []  # rows, wall, cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def poll(self, now: float) -> Step:
        return self.inner.poll(now)

    def complete(self, batch: Batch, started: float, finished: float,
                 cpu_s: float | None = None) -> None:
        assert cpu_s is not None
        self.completed.append((batch.rows, finished - started, cpu_s))
        self.inner.complete(batch, started, finished, cpu_s)


def _spied(cost: dict[str, Any], tmp_path: Path | None = None, rate: float = 20.0,
           kind: str = "none", rows: int = 2) -> Spy:
    data = dict(SMALL, cost=cost, request_size=rows, phases=[{"seconds": 5, "rate": rate}])
    spy = Spy(kind)
    simulate(parse_scenario(data, "small", tmp_path or "."), policy=spy)  # type: ignore[arg-type]
    assert spy.completed
    return spy


EXACT = {"intercept_ms": 5, "per_item_ms": 0.5}  # no noise: every 2-row batch costs 6 ms


def test_without_machine_keys_wall_time_is_the_cost() -> None:
    for rows, wall, cpu in _spied(EXACT).completed:
        assert (rows, wall, cpu) == (2, pytest.approx(0.006, abs=1e-12), 0.006)


def test_a_certain_stall_adds_exactly_its_milliseconds_to_wall_time_only() -> None:
    spy = _spied(dict(EXACT, stalls={"probability": 1, "ms": 200}), rate=2.0)
    for _, wall, cpu in spy.completed:
        assert cpu == 0.006
        assert wall == pytest.approx(0.206, abs=1e-12)


def test_contention_scales_wall_time_by_the_recent_arrival_rate_not_cpu() -> None:
    cost = Cost(5.0, 0.5, contention=Contention(per_krps=0.5, window_ms=100.0))
    arrivals = [0.001 * i for i in range(1, 201)]  # 1000 req/s up to 0.2 s
    timer = BatchTimer(random.Random(1), random.Random(2), arrivals)
    taken = timer.draw(cost, 10, 0.2)  # 100 arrivals in (0.1, 0.2]: 1 krps
    assert taken.cpu_s == 0.01
    assert taken.wall_s == pytest.approx(0.01 * 1.5, abs=1e-12)
    assert taken.per_row_s == pytest.approx(0.0005 * 1.5, abs=1e-12)
    assert timer.draw(cost, 10, 5.0).wall_s == 0.01  # nothing arrived lately: no stretch


def test_contention_in_a_run_follows_the_rate() -> None:
    cheap = {"intercept_ms": 1, "per_item_ms": 0.1, "contention": {"per_krps": 0.5}}
    for rate in (200.0, 2000.0):
        spy = _spied(cheap, rate=rate, kind="greedy", rows=1)
        assert all(cpu == pytest.approx(0.001 + 0.0001 * rows) for rows, _, cpu in spy.completed)
        stretch = sorted(wall / cpu for _, wall, cpu in spy.completed)
        assert stretch[0] >= 1.0 - 1e-9
        median = stretch[len(stretch) // 2]
        assert median == pytest.approx(1.0 + 0.5 * rate / 1000.0, rel=0.2)


class FixedDraws(random.Random):
    def __init__(self, uniform: float, pareto: float) -> None:
        super().__init__(0)
        self.uniform, self.pareto = uniform, pareto

    def random(self) -> float:
        return self.uniform

    def paretovariate(self, alpha: float) -> float:
        return self.pareto


def test_a_tail_hit_multiplies_wall_time_by_scale_times_pareto() -> None:
    cost = Cost(5.0, 0.5, tail=Tail(share=0.05, scale=2.0, alpha=3.0))
    hit = BatchTimer(random.Random(1), FixedDraws(0.01, 1.5), [])
    miss = BatchTimer(random.Random(1), FixedDraws(0.06, 1.5), [])
    assert hit.draw(cost, 2, 0.0) == (pytest.approx(0.018), 0.006, pytest.approx(0.0015))
    assert miss.draw(cost, 2, 0.0) == (0.006, 0.006, 0.0005)


def test_a_tail_of_share_one_stretches_every_batch_at_least_scale() -> None:
    spy = _spied(dict(EXACT, tail={"share": 1, "scale": 2.0}))
    assert all(cpu == 0.006 and wall >= 0.012 - 1e-12 for _, wall, cpu in spy.completed)
    assert len({wall for _, wall, _ in spy.completed}) > 1


def test_machine_keys_at_zero_change_nothing() -> None:
    plain = parse_scenario(SMALL, "small")
    idle = dict(SMALL["cost"], contention={"per_krps": 0}, tail={"share": 0, "scale": 3},  # type: ignore[arg-type]
                stalls={"probability": 0, "ms": 100})
    zero = parse_scenario(dict(SMALL, cost=idle), "small")
    for kind in ("adaptive", "bentoml"):
        assert replace(simulate(plain, kind), wall_s=0.0, refit_ms_mean=0.0, refit_ms_max=0.0) \
            == replace(simulate(zero, kind), wall_s=0.0, refit_ms_mean=0.0, refit_ms_max=0.0)


RECORDED = "rows,wall_s,cpu_s\n1,0.002,0.001\n1,0.003,0.001\n4,0.010,0.004\n"


def test_replay_samples_recorded_batches_of_the_nearest_row_count(tmp_path: Path) -> None:
    (tmp_path / "log.csv").write_text(RECORDED)
    recording = load_recording(tmp_path / "log.csv")
    assert (recording.intercept_s, recording.slope_s) == (0.0, pytest.approx(0.001))
    assert [recording.nearest(n) for n in (1, 2, 3, 4, 9)] == [0, 0, 1, 1, 1]
    spy = _spied({"replay": "log.csv"}, tmp_path)
    for rows, _, cpu in spy.completed:
        assert rows == 2  # nearest recorded is 1 row; scaled by line(2) / line(1) = 2
        assert cpu == 0.002
    assert {round(wall, 12) for _, wall, _ in spy.completed} == {0.004, 0.006}


def test_a_log_with_the_predicted_column_replays_as_one_without(tmp_path: Path) -> None:
    """A live runner's log also holds each batch's prediction, which a replay leaves aside."""
    predicted = "rows,wall_s,cpu_s,predicted_s\n1,0.002,0.001,0.004\n1,0.003,0.001,0.004\n" \
        "4,0.010,0.004,0.012\n"
    (tmp_path / "three.csv").write_text(RECORDED)
    (tmp_path / "four.csv").write_text(predicted)
    three, four = (load_recording(tmp_path / name) for name in ("three.csv", "four.csv"))
    assert replace(three, path="") == replace(four, path="")


def test_replay_paths_are_relative_to_the_scenario_file(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "log.csv").write_text(RECORDED)
    data = dict(SMALL, cost={"replay": "logs/log.csv"})
    (tmp_path / "replayed.yml").write_text(json.dumps(data))
    cost = load_scenario(tmp_path / "replayed.yml").phases[0].cost
    assert cost.replay is not None and cost.replay.sizes == (1, 4)


@pytest.mark.parametrize(
    ("cost", "message"),
    [
        (dict(EXACT, stalls={"probability": 2, "ms": 5}),
         r"^small\.cost\.stalls\.probability has value 2; it must be a number from 0 to 1$"),
        (dict(EXACT, stalls={"probability": 0.1}),
         r"^small\.cost\.stalls\.ms has value None; it must be a number at least 0$"),
        (dict(EXACT, contention={"per_krps": 1, "speed": 2}),
         r"^small\.cost\.contention has unknown key 'speed'; known: \['per_krps', 'window_ms'\]$"),
        (dict(EXACT, contention={"per_krps": 1, "window_ms": 0}),
         r"^small\.cost\.contention\.window_ms has value 0; it must be a number greater than 0$"),
        (dict(EXACT, tail={"share": 0.1, "scale": 0.5}),
         r"^small\.cost\.tail\.scale has value 0\.5; it must be a number at least 1$"),
        (dict(EXACT, tail={"share": "x", "scale": 2}),
         r"^small\.cost\.tail\.share has value 'x'; it must be a number from 0 to 1$"),
        ({"replay": "missing.csv"},
         r"^small\.cost\.replay has value 'missing\.csv'; it must name a batch log with header "
         r"rows,wall_s,cpu_s relative to the scenario file \(cannot read"),
        ({"replay": "log.csv", "intercept_ms": 5},
         r"^small\.cost has keys 'replay' and 'intercept_ms'; a replayed cost takes neither"),
        ({"replay": 3}, r"^small\.cost\.replay has value 3; it must be the path of a batch log$"),
    ],
)
def test_machine_key_errors_name_the_dotted_path(cost: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(dict(SMALL, cost=cost), "small")


def test_a_bad_recording_names_its_line(tmp_path: Path) -> None:
    (tmp_path / "bad.csv").write_text("rows,wall_s,cpu_s\n1,0.002,0.001\n0,0.001,0.001\n")
    with pytest.raises(ScenarioError, match=r"bad\.csv:3 has '0,0\.001,0\.001'; rows must be"):
        parse_scenario(dict(SMALL, cost={"replay": "bad.csv"}), "small", tmp_path)


def test_a_phase_switches_between_replay_and_synthetic_cost(tmp_path: Path) -> None:
    (tmp_path / "log.csv").write_text(RECORDED)
    data = dict(SMALL, phases=[
        {"seconds": 1, "rate": 10},
        {"seconds": 1, "rate": 10, "cost": {"replay": "log.csv", "stalls": {
            "probability": 0.5, "ms": 10}}},
        {"seconds": 1, "rate": 10, "cost": {"intercept_ms": 7, "per_item_ms": 1}},
    ])
    first, second, third = (phase.cost for phase in parse_scenario(data, "s", tmp_path).phases)
    assert first.replay is None and not first.inflated
    assert second.replay is not None and second.stalls == Stalls(0.5, 10.0)
    assert third.replay is None and (third.intercept_ms, third.noise) == (7.0, 0.05)
    assert third.stalls == Stalls(0.5, 10.0)  # carried on, like every key a phase names


def test_shipped_machine_scenarios_load() -> None:
    for name in ("contended_80", "stalls", "replay_mlp", "overload_contended"):
        assert load_scenario(SCENARIOS / f"{name}.yml").phases[0].cost.inflated


def test_given_arrivals_replace_the_scenarios_poisson_traffic() -> None:
    scenario = parse_scenario(SMALL, "small")
    result = simulate(scenario, traffic=[(0.1, 1), (0.2, 3), (0.5, 1)])
    assert (result.requests, result.ok, result.rejected) == (3, 3, 0)
    assert result.mean_batch_size * result.batches == 5  # every row, at the times given
