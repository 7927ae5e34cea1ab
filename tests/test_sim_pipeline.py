"""A pipeline in the simulator and the planner: its steps in turn, each its runner's policy,
under one deadline; a saturated later step refuses at the entrance; a plan of the bundled
`classify` per step; the commands' errors in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchserve.runner.core.config import RunnerConfig, parse
from batchserve.runner.policy.base import Policy, Request
from batchserve.runner.policy.policies import build_policy
from batchserve.runner.sim import plan_cli, simulate
from batchserve.runner.sim.pipeline import Station, simulate_pipeline
from batchserve.runner.sim.scenario import Scenario, ScenarioError, parse_scenario

ROOT = Path(__file__).resolve().parent.parent
CLASSIFY = ROOT / "benchmarks" / "pipelines" / "classify.yml"
BUNDLED = ROOT / "configuration.yml"


def tensors(name: str) -> list[dict[str, object]]:
    return [{"name": name, "datatype": "FP32", "shape": [-1, 2]}]


CONFIG = parse({
    "runners": {
        "fast": {"model": "m:f", "inputs": tensors("x"), "outputs": tensors("y"),
                 "batching": {"max_batch_size": 32, "max_latency_ms": 100}},
        "slow": {"model": "m:s", "inputs": tensors("y"), "outputs": tensors("z"),
                 "batching": {"max_batch_size": 4, "max_latency_ms": 100}},
    },
    "pipelines": {"chain": {"max_latency_ms": 100,
                            "steps": [{"runner": "fast"}, {"runner": "slow"}]}},
})


def chain(rate: float) -> tuple[Scenario, list[Station]]:
    """`fast` then `slow`: `slow` serves 4 rows in 40 ms, 100 requests a second at most."""
    scenario = parse_scenario({
        "slo_ms": 100, "cost": {"intercept_ms": 1, "per_item_ms": 0.05},
        "runners": {"slow": {"intercept_ms": 20, "per_item_ms": 5}},
        "phases": [{"seconds": 10, "rate": rate}],
    }, "chain")
    steps = [Station(CONFIG.runners[step.runner], scenario.costs_of(step.runner))
             for step in CONFIG.pipelines["chain"].steps]
    return scenario, steps


def test_a_saturated_second_step_refuses_at_the_entrance() -> None:
    scenario, steps = chain(rate=300)
    result = simulate_pipeline(scenario, "chain", steps)
    fast, slow = result.steps
    assert result.late == 0
    assert 90 <= result.goodput_rps <= 110  # what `slow` can carry
    # Refused before the first step ran, naming the second; few get past the entrance.
    assert result.rejected_at_entrance == slow.refused_at_entrance
    assert result.rejected_at_entrance >= 0.9 * result.rejected > 0
    assert fast.refused == fast.refused_at_entrance == 0
    # Every request past the entrance ran the first step; none refused there did.
    fast_rows = fast.batches * fast.mean_batch_size
    assert fast_rows == pytest.approx(result.requests - result.rejected_at_entrance)
    assert slow.mean_batch_size == pytest.approx(4.0, abs=0.1)


def test_a_chain_within_its_capacity_refuses_nothing() -> None:
    scenario, steps = chain(rate=40)
    result = simulate_pipeline(scenario, "chain", steps)
    assert (result.rejected, result.late) == (0, 0)
    assert result.ok == result.requests > 300
    assert result.p99_ms < 100


def test_each_step_is_offered_what_is_left_less_the_steps_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    offered: dict[str, list[Request]] = {"fast": [], "slow": []}

    def recording(runner: RunnerConfig) -> Policy:
        policy = build_policy(runner)
        offer = policy.offer

        def spy(request: Request, now: float) -> bool:
            assert request.arrival == now
            offered[runner.name].append(request)
            return offer(request, now)

        policy.offer = spy  # type: ignore[method-assign]
        return policy

    monkeypatch.setattr("batchserve.runner.sim.pipeline.build_policy", recording)
    scenario, steps = chain(rate=40)
    simulate_pipeline(scenario, "chain", steps)
    entered = {request.id: request.arrival for request in offered["fast"]}
    # The first step keeps back the second's time: at least a batch of one row, 25 ms.
    assert max(r.deadline - r.arrival for r in offered["fast"]) <= 0.100 - 0.025 + 1e-9
    # The last step gets whatever is left of the request's one deadline.
    assert len(offered["slow"]) == len(entered) > 300
    for request in offered["slow"]:
        assert request.deadline == pytest.approx(entered[request.id] + 0.100)


def test_a_runner_used_twice_is_one_set_of_processes() -> None:
    config = parse({
        "runners": {"fast": {"model": "m:f", "inputs": tensors("x"), "outputs": tensors("y"),
                             "batching": {"max_batch_size": 8}}},
        "pipelines": {"again": {"max_latency_ms": 100, "steps": [
            {"runner": "fast"},
            {"runner": "fast", "input_map": {"x": "y"}, "output_map": {"y": "twice"}}]}},
    })
    scenario = parse_scenario({"cost": {"intercept_ms": 1, "per_item_ms": 0.1},
                               "phases": [{"seconds": 2, "rate": 100}]}, "again")
    steps = [Station(config.runners["fast"], scenario.costs_of("fast"))] * 2
    result = simulate_pipeline(scenario, "again", steps)
    assert result.ok == result.requests > 100
    first, second = result.steps
    assert first.batches == second.batches  # one runner's batches, both steps' calls
    rows = first.batches * first.mean_batch_size
    assert rows == pytest.approx(2 * result.ok)


def test_a_runner_cost_overrides_the_phases() -> None:
    scenario = parse_scenario({
        "cost": {"intercept_ms": 1, "per_item_ms": 0.1, "noise": 0.05},
        "runners": {"slow": {"per_item_ms": 2}},
        "phases": [{"seconds": 1, "rate": 10},
                   {"seconds": 1, "rate": 10, "cost": {"intercept_ms": 3}}],
    }, "costs")
    assert [(c.intercept_ms, c.per_item_ms, c.noise) for c in scenario.costs_of("slow")] == [
        (1, 2, 0.05), (3, 2, 0.05)]
    assert [c.intercept_ms for c in scenario.costs_of("fast")] == [1, 3]
    with pytest.raises(ScenarioError, match=r"^costs.runners has value \[1\]; it must be a "
                                            "mapping of runner names to costs$"):
        parse_scenario({"cost": {"intercept_ms": 1, "per_item_ms": 0.1}, "runners": [1],
                        "phases": [{"seconds": 1, "rate": 1}]}, "costs")


# --- the commands ---------------------------------------------------------------------------


def test_simulate_runs_the_bundled_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate.main([str(CLASSIFY), "--pipeline", "classify", "--config", str(BUNDLED),
                          "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pipeline"] == "classify" and report["limit_ms"] == 100
    assert [step["runner"] for step in report["steps"]] == ["tokenize", "text"]
    assert report["ok"] > 0 and report["late"] <= 0.001 * report["requests"]


@pytest.mark.parametrize(("args", "message"), [
    (["--pipeline", "nope"],
     f"--pipeline has value 'nope'; it must be a pipeline of {BUNDLED} (classify)"),
    (["--pipeline", "classify", "--config", str(ROOT / "examples" / "models.yml")],
     f"--pipeline has value 'classify'; it must be a pipeline of "
     f"{ROOT / 'examples' / 'models.yml'} (it has none)"),
])
def test_simulate_names_an_unknown_pipeline_in_one_line(
        capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    argv = [str(CLASSIFY), "--config", str(BUNDLED), *args]
    assert simulate.main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"batchserve simulate: error: {message}\n")


def test_plan_recommends_each_step_of_the_bundled_pipeline(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = plan_cli.main(["--pipeline", "classify", "--config", str(BUNDLED),
                          "--fit", "tokenize=0.05,0.02", "--fit", "text=0.5,0.2",
                          "--target", "500", "--processes", "1", "--max-batch-sizes", "8,64",
                          "--seconds", "1", "--cores", "2", "--json"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["pipeline"] == "classify" and report["target_rps"] == 500
    tokenize, text = report["steps"]
    assert (tokenize["runner"], text["runner"]) == ("tokenize", "text")
    assert tokenize["limit_ms"] + text["limit_ms"] == pytest.approx(100)
    assert text["limit_ms"] > tokenize["limit_ms"]  # its batches take longer
    for step in (tokenize, text):
        assert [(s["processes"], s["max_batch_size"]) for s in step["settings"]] == [
            (1, 8), (1, 64)]
        assert step["recommended"] == {"processes": 1, "max_batch_size": 8}
    assert report["chain"]["passed"]
    assert [s["runner"] for s in report["chain"]["simulated"]["steps"]] == ["tokenize", "text"]


@pytest.mark.parametrize(("args", "message"), [
    (["--pipeline", "nope", "--fit", "tokenize=1,1"],
     f"--pipeline has value 'nope'; it must be a pipeline of {BUNDLED} (classify)"),
    (["--pipeline", "classify", "--fit", "tokenize=1,1"],
     "--fit gives no line for runner 'text' of the pipeline; give "
     "--fit text=INTERCEPT_MS,SLOPE_MS"),
    (["--pipeline", "classify", "--fit", "1,1"],
     "--fit has value '1,1'; for a pipeline it must be RUNNER=INTERCEPT_MS,SLOPE_MS, once "
     "for each of its runners: tokenize, text"),
    (["--pipeline", "classify", "--batch-log", str(CLASSIFY)],
     f"--batch-log has value {str(CLASSIFY)!r}; for a pipeline it must be the folder"),
])
def test_plan_says_what_is_wrong_with_a_pipeline_in_one_line(
        capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert plan_cli.main([*args, "--config", str(BUNDLED), "--rate", "100"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"batchserve plan: error: {message}")
    assert err.count("\n") == 1
