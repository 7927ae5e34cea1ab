"""The known-line policy behind `benchmarks.at_arrival_bound`: a frontier is only worth
quoting if the policy drawing it keeps its promises when it knows everything it assumes."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from batchserve.runner.sim.scenario import Scenario, load_scenario
from batchserve.runner.sim.simulate import simulate
from benchmarks.at_arrival_bound import (
    DecideLaterPolicy,
    DropOldestPolicy,
    KnownLinePolicy,
    frontier,
    known_line,
    main,
    summary_row,
    variants,
    without_noise,
)
from benchmarks.targets import frontier_point, late_share

SCENARIOS = Path(__file__).parent.parent / "benchmarks" / "scenarios"


def _short(name: str, seconds: float = 5.0) -> Scenario:
    """The scenario's busiest (last) phase alone, for `seconds`."""
    scenario = load_scenario(SCENARIOS / f"{name}.yml")
    return replace(scenario, phases=(replace(scenario.phases[-1], seconds=seconds),))


@pytest.mark.parametrize("name", ["tight_12ms", "tight_slo"])
def test_without_noise_a_known_line_promise_is_never_broken(name: str) -> None:
    # Joiners beyond the expected ones would make an earlier request late if admission did
    # not check the batch as it stands against its earliest deadline.
    scenario = without_noise(_short(name))
    run = simulate(scenario, "known-line", policy=KnownLinePolicy(scenario, 0.0))
    assert run.requests > 1000
    assert run.ok + run.rejected == run.requests
    assert run.rejected > 0  # the load is beyond what the limit lets it serve
    assert run.late == 0


def test_a_larger_reserve_trades_goodput_for_lateness() -> None:
    scenario = _short("tight_12ms", 20.0)
    bold, careful = (simulate(scenario, "known-line", policy=KnownLinePolicy(scenario, r))
                     for r in (0.0, 3.0))
    assert careful.late < bold.late
    assert careful.goodput_rps < bold.goodput_rps


def test_a_cost_with_inflated_batch_times_is_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="stalls has replayed or inflated batch times"):
        KnownLinePolicy(load_scenario(SCENARIOS / "stalls.yml"), 1.0)
    assert main(["stalls"]) == 2
    assert "plain cost line" in capsys.readouterr().err


def test_a_deferred_decision_refuses_within_its_horizon_and_keeps_its_promises() -> None:
    scenario = without_noise(_short("tight_12ms"))
    horizon_s = 0.1 * scenario.slo_ms / 1000.0
    run = simulate(scenario, "later", policy=DecideLaterPolicy(scenario, 0.0, horizon_s))
    assert run.ok + run.rejected == run.requests
    assert run.rejected > 0
    assert run.rejected_at_arrival < run.rejected  # some were settled after a wait ...
    assert run.reject_wait_p99_ms <= horizon_s * 1000.0 + 1e-6  # ... never a long one
    assert run.late == 0


def test_dropping_the_oldest_refuses_only_after_a_wait_and_keeps_its_promises() -> None:
    scenario = without_noise(_short("tight_12ms"))
    run = simulate(scenario, "drop-oldest", policy=DropOldestPolicy(scenario, 0.0))
    assert run.ok + run.rejected == run.requests
    assert run.rejected > 0
    assert run.rejected_at_arrival == 0
    assert run.reject_wait_p99_ms > 0.1 * scenario.slo_ms  # they waited for a batch
    assert run.late == 0


ROW = re.compile(r"^\| (?P<label>[^|]+) \| (?P<goodput>[\d.]+) \| (?P<ratio>[\d.]+) \| "
                 r"(?P<late>[\d.]+) \| (?P<false>[\d.]+) \| (?P<wait>[\d.]+) \|$")
RULES = ("known line", "decided within 10% of the limit", "dropping the oldest")


def test_the_table_names_the_best_goodput_of_each_rule_within_each_late_bound() -> None:
    lines = frontier(_short("tight_12ms"), (0.0, 2.0), seed=1)
    assert lines[0] == "tight_12ms, seed 1:"
    assert all(line.count("|") == 7 for line in lines if line.startswith("| "))
    rows = {m["label"]: m for line in lines if (m := ROW.match(line))}
    # The bounds, in percent: 0.1%, and BentoML's own lateness (at least 0.1%).
    bounds = {"0.1%": 0.1, "BentoML's": max(0.1, float(rows["BentoML"]["late"]))}
    expected, cases = set(), set()
    for rule in RULES:
        own = [row for label, row in rows.items() if label.startswith(f"{rule}, reserve ")]
        assert len(own) == 2
        for bound_name, bound in bounds.items():
            # Rounded to the table's digits, no row sits on a bound or ties another's goodput.
            assert all(float(row["late"]) != bound for row in own)
            kept = [row for row in own if float(row["late"]) < bound]
            assert len({row["goodput"] for row in kept}) == len(kept)
            head = f"best {rule} goodput with late <= {bound_name} ({bound:.3f}%): "
            if not kept:
                expected.add(f"{head}none within it")
                cases.add("none within the bound")
                continue
            best = max(kept, key=lambda row: float(row["goodput"]))
            expected.add(f"{head}{best['goodput']} req/s, {best['ratio']} of BentoML's, false "
                         f"refusals {best['false']}%, refusal wait p99 {best['wait']} ms")
            if any(float(row["goodput"]) > float(best["goodput"]) for row in own):
                cases.add("a bolder row left out")
            if len(kept) > 1:
                cases.add("the best of several")
    assert {line for line in lines if line.startswith("best ")} == expected
    assert cases == {"none within the bound", "a bolder row left out", "the best of several"}


def test_known_line_runs_the_policy_at_a_reserve_on_the_seeds_arrivals() -> None:
    scenario = _short("tight_12ms")
    run = known_line(scenario, 2.0, seed=3)
    direct = simulate(scenario, "direct", seed=3, policy=KnownLinePolicy(scenario, 2.0))
    assert run.policy == "known line, reserve 2 sigma"
    assert replace(run, policy="direct", wall_s=0.0) == replace(direct, wall_s=0.0)
    assert run.requests != known_line(scenario, 2.0).requests  # seed 1 draws other arrivals


def test_the_frontier_point_at_our_lateness_is_the_boldest_run_that_late() -> None:
    scenario = _short("tight_12ms", 20.0)
    bold, careful = (known_line(scenario, r) for r in (0.0, 3.0))
    assert frontier_point([bold, careful], late_share(careful)) is careful
    assert frontier_point([bold, careful], late_share(bold)) is bold


def test_the_summary_takes_every_scenario_with_and_without_its_noise() -> None:
    names = [scenario.name for scenario in variants()]
    assert "tight_12ms" in names and "tight_12ms (no noise)" in names
    assert "replay_mlp" in names and "replay_mlp (no noise)" not in names  # nothing to take


def test_a_summary_row_sets_the_adaptive_policy_against_the_frontier() -> None:
    row = summary_row(without_noise(_short("tight_slo", 3.0)), 1)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == 9 and cells[0] == "tight_slo (no noise)"
    assert float(cells[1]) == 0.0  # late % of the adaptive policy: no noise, no bias
    assert all(float(cell) > 0.9 for cell in cells[6:])


def test_a_cost_with_inflated_batch_times_has_no_frontier_in_the_summary() -> None:
    scenario = load_scenario(SCENARIOS / "stalls.yml")
    scenario = replace(scenario, phases=(replace(scenario.phases[0], seconds=1.0),))
    assert "no frontier" in summary_row(scenario, 1)
