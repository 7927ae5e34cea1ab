"""`batchserve plan`: the machine model, traffic scaling, the planner on synthetic and recorded
costs, the command line end to end, and a live server's latency model read from /metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchserve.runner.sim import plan_cli
from batchserve.runner.sim.plan import (
    Inputs,
    Machine,
    Setting,
    Traffic,
    cpu_only,
    evaluate,
    plan,
    plan_setting,
    recommend,
    shared_slowdown,
)
from batchserve.runner.sim.recording import load_recording, merge
from batchserve.runner.sim.scenario import Cost
from tests.conftest import Server, wait_for

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "benchmarks" / "scenarios" / "recorded" / "mlp-closed32.csv"
MLP = """
runners:
  mlp:
    model: batchserve.runner.bundled:mlp
    batching: {max_batch_size: 64, max_latency_ms: 100}
    inputs: [{name: x, datatype: FP32, shape: [-1, 256]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 16]}]
"""
# 5 ms a batch and 0.5 ms a row: full batches of 64 carry 64 / 37 ms = 1,730 rows/s.
SLOW = Cost(5.0, 0.5, noise=0.05)


def inputs(machine: Machine, rate: float = 1000.0, cost: Cost = SLOW) -> Inputs:
    return Inputs(cost, machine, Traffic(((1.0, rate),)), limit_ms=100.0)


# --- the machine ----------------------------------------------------------------------------


def test_one_core_slows_a_thread_as_its_busy_share_says() -> None:
    machine = Machine(cores=1, front_s=0.0)
    for load in (0.1, 0.5, 0.9):
        # Busy while any thread is runnable: 1 - exp(-load * slowdown) = load.
        assert shared_slowdown(1, load) == pytest.approx(-math.log(1.0 - load) / load)
        assert machine.stretch(load) == pytest.approx(-math.log(1.0 - load) / load)
    assert shared_slowdown(1, 0.0) == 1.0


def test_two_cores_slow_a_thread_less_than_one_at_the_same_share() -> None:
    slowdown = shared_slowdown(2, 1.0)
    runnable = slowdown * 1.0  # Little's law: the mean runnable threads
    busy = 2.0 - math.exp(-runnable) * (2.0 + runnable)  # E[min(n, 2)], n Poisson
    assert busy == pytest.approx(1.0)
    assert 1.0 < slowdown < shared_slowdown(1, 0.5)


def test_the_slowdown_grows_with_the_work_and_stays_near_what_batch_logs_show() -> None:
    slowdowns = [shared_slowdown(2, load) for load in (0.5, 1.0, 1.5, 1.65, 1.85, 1.99)]
    assert slowdowns == sorted(slowdowns)
    # The bundled mlp's batches ran 1.4 to 1.9 times their CPU time at 1.65 to 1.85 cores.
    assert 1.4 < shared_slowdown(2, 1.65) < shared_slowdown(2, 1.85) < 2.0


def test_demand_at_or_over_the_cores_cannot_be_carried() -> None:
    machine = Machine(cores=2, front_s=0.001, batch_s=0.002, client_s=0.0005, busy_cores=0.5)
    assert machine.demand(1000.0, 100.0, 0.25) == pytest.approx(0.5 + 1.5 + 0.2 + 0.25)
    assert machine.stretch(2.0) == float("inf")


def test_a_load_generator_here_is_one_queue_that_adds_its_wait_and_saturates() -> None:
    machine = Machine(cores=2, front_s=0.0, client_s=0.0005)
    assert Machine(cores=2, front_s=0.0).client_wait_s(1000.0, 1.0) == 0.0  # none here
    assert machine.client_wait_s(10.0, 1.0) == 0.0  # rarely waits: no p99 wait
    # At 1,000 req/s it is busy half the time: p99 wait ln(50) / (2,000 - 1,000) s.
    assert machine.client_wait_s(1000.0, 1.0) == pytest.approx(math.log(50.0) / 1000.0)
    assert machine.client_wait_s(1000.0, 1.5) > machine.client_wait_s(1000.0, 1.0)
    assert machine.client_wait_s(2000.0, 1.0) == float("inf")  # it cannot keep up


def test_a_client_on_the_same_cores_bounds_what_passes() -> None:
    alone = plan_setting(inputs(Machine(cores=2, front_s=0.0001)), Setting(1, 64), 1000.0)
    beside = plan_setting(inputs(Machine(cores=2, front_s=0.0001, client_s=0.001)),
                          Setting(1, 64), 1000.0)
    assert beside.passing_rps < 1000.0 < alone.passing_rps


# --- traffic --------------------------------------------------------------------------------


def test_phases_scale_to_a_mean_rate_and_keep_their_shape() -> None:
    traffic = Traffic(((1.0, 100.0), (3.0, 300.0)))
    assert traffic.mean_rate == 250.0
    assert traffic.at(500.0).phases == ((1.0, 200.0), (3.0, 600.0))


def test_recorded_arrivals_are_compressed_and_shared_among_processes() -> None:
    traffic = Traffic.from_arrivals([10.0 + i / 100.0 for i in range(1001)])  # 100/s for 10 s
    faster = traffic.at(2 * traffic.mean_rate)
    assert faster.recorded[-1] == pytest.approx(5.0)
    share = faster.share(4, seed=1)
    assert share is not None
    assert 200 < len(share) < 300  # each arrival kept with chance 1/4
    assert Traffic(((1.0, 5.0),)).share(4, seed=1) is None


def test_recorded_arrivals_need_a_span() -> None:
    with pytest.raises(ValueError, match="must span some time"):
        Traffic.from_arrivals([1.0, 1.0])


# --- the planner ----------------------------------------------------------------------------


def test_a_rate_the_cores_cannot_carry_is_saturated_without_simulating() -> None:
    machine = Machine(cores=1, front_s=0.001)  # the front alone fills the core at 1,000/s
    point = evaluate(inputs(machine), Setting(1, 64), 1200.0)
    assert point.saturated and not point.passed
    assert point.goodput_rps == 0.0


def test_one_process_passes_up_to_near_what_full_batches_carry() -> None:
    plenty = Machine(cores=16, front_s=0.0)
    result = plan_setting(inputs(plenty), Setting(1, 64), target=1000.0)
    assert 1200.0 < result.passing_rps < 1800.0  # 64 rows / 37 ms = 1,730 req/s
    assert result.target.passed and result.target.goodput_rps == pytest.approx(1000.0, rel=0.1)


def test_processes_add_up_on_idle_cores_but_not_on_a_full_machine() -> None:
    plenty = inputs(Machine(cores=16, front_s=0.0))
    one, two = plan(plenty, [Setting(2, 64), Setting(1, 64)], target=1000.0)
    assert (one.setting.processes, two.setting.processes) == (1, 2)  # ordered
    assert two.passing_rps > 1.6 * one.passing_rps
    # One core that the front already half fills: a second process has no core to run on.
    # Passing rates are found to about 2% of the ceiling (24 req/s here), so the bound
    # leaves a step or two beside the 12-15% more that the plan gives a second process here.
    tight = inputs(Machine(cores=1, front_s=0.0003))
    one, two = plan(tight, [Setting(1, 64), Setting(2, 64)], target=1000.0)
    assert two.passing_rps < 1.2 * one.passing_rps
    assert max(one.passing_rps, two.passing_rps) < 1000.0  # 0.3 ms + the model's share


def test_the_front_costs_capacity() -> None:
    light = plan_setting(inputs(Machine(cores=2, front_s=0.0001)), Setting(1, 64), 1000.0)
    heavy = plan_setting(inputs(Machine(cores=2, front_s=0.0008)), Setting(1, 64), 1000.0)
    assert heavy.passing_rps < 0.8 * light.passing_rps


def test_recommend_takes_the_smallest_setting_that_passes_at_the_target() -> None:
    plenty = inputs(Machine(cores=16, front_s=0.0))
    plans = plan(plenty, [Setting(1, 64), Setting(2, 64), Setting(4, 64)], target=2500.0)
    assert not plans[0].target.passed
    best = recommend(plans)
    assert best is not None and best.setting == Setting(2, 64)


def test_a_recorded_log_is_replayed_on_its_cpu_time() -> None:
    recording = load_recording(RECORDED)
    cpu = cpu_only(recording)
    assert (cpu.sizes, cpu.intercept_s, cpu.slope_s) == \
        (recording.sizes, recording.intercept_s, recording.slope_s)
    for group in cpu.times:
        assert all(wall == cost for wall, cost in group)
    merged = merge([recording, recording])
    assert merged.batches == 2 * recording.batches
    assert merged.slope_s == pytest.approx(recording.slope_s)


# --- the command line -----------------------------------------------------------------------


def write_config(tmp_path: Path) -> Path:
    config = tmp_path / "configuration.yml"
    config.write_text(MLP)
    return config


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = plan_cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_plans_from_a_batch_log_and_draws_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    logs = tmp_path / "logs"
    logs.mkdir()
    text = RECORDED.read_text().splitlines()
    (logs / "mlp-1.csv").write_text("\n".join(text[:500]) + "\n")
    (logs / "mlp-2.csv").write_text("\n".join([text[0], *text[500:]]) + "\n")
    png = tmp_path / "plan.png"
    code, out, err = run(["--batch-log", str(logs), "--config", str(write_config(tmp_path)),
                          "--target", "800", "--processes", "1,2", "--seconds", "1",
                          "--cores", "2", "--png", str(png)], capsys)
    assert (code, err) == (0, "")
    assert "1079 recorded batches" in out
    assert "| 1 | 64 |" in out and "| 2 | 64 |" in out
    assert "smallest setting that carries 800 req/s within 100 ms: 1 process(es), " \
           "max_batch_size 64" in out
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_the_command_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--fit", "1,0.05", "--config", str(write_config(tmp_path)),
                        "--phases", "1:200,1:600", "--processes", "1",
                        "--max-batch-sizes", "8,32", "--cores", "2", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["target_rps"] == 400.0  # the phases' mean
    assert [(s["processes"], s["max_batch_size"]) for s in report["settings"]] == [(1, 8), (1, 32)]
    assert report["recommended"] == {"processes": 1, "max_batch_size": 8}
    assert report["cost"] == "CPU 1 ms + 0.05 ms/row, noise 0.1"


def test_a_runner_of_ragged_inputs_is_planned_in_elements(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its batches are counted and capped in elements (`max_batch_elements`), so are the
    plan's, by default, and a request's rows are its sequence's elements."""
    config = tmp_path / "encoder.yml"
    config.write_text(ENCODER)
    code, out, _ = run(["--fit", "5,0.05", "--config", str(config), "--rate", "100",
                        "--rows", "64", "--processes", "1", "--cores", "2", "--json"], capsys)
    assert code == 0
    assert [s["max_batch_size"] for s in json.loads(out)["settings"]] == [2048]


ENCODER = """
runners:
  encoder:
    model: batchserve.runner.encoder:Encoder
    batching: {max_batch_size: 32, max_batch_elements: 2048, max_latency_ms: 100}
    inputs: [{name: tokens, datatype: INT64, shape: [-1], ragged: true}]
    batch_inputs: [{kind: accumulated_element_count, name: offsets, source: tokens}]
    outputs: [{name: embedding, datatype: FP32, shape: [-1, 256]}]
"""


@pytest.mark.parametrize(("args", "message"), [
    (["--fit", "1,0.05"], "give the traffic (--rate, --phases or --arrivals) or --target"),
    (["--fit", "1", "--rate", "100"], "--fit has value '1'; it must be 2 numbers at least 0"),
    (["--fit", "1,0.05", "--rate", "100", "--runner", "nope"],
     "--runner has value 'nope'; the configuration has mlp"),
    (["--fit", "1,0.05", "--phases", "1:x"], "--phases has value '1:x'; it must be"),
    (["--batch-log", ".", "--rate", "100"], "holds no batch log of runner 'mlp' (mlp-<pid>.csv)"),
])
def test_the_command_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run([*args, "--config", str(write_config(tmp_path))], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("batchserve plan: error: ") and message in err


def test_recorded_arrivals_are_read_with_a_header(tmp_path: Path) -> None:
    path = tmp_path / "arrivals.csv"
    path.write_text("time_s,other\n0.5,x\n# a comment\n0.75\n")
    assert plan_cli.arrivals(path) == [0.5, 0.75]
    path.write_text("0.5\nlater\n")
    with pytest.raises(plan_cli.PlanError, match=r"arrivals.csv:2 has 'later'"):
        plan_cli.arrivals(path)


# --- a live server's latency model ----------------------------------------------------------


def gauge(text: str, name: str) -> float:
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == name and s.labels.get("runner") == "mlp"]
    return values[0] if len(values) == 1 else float("nan")


def test_the_plan_reads_a_running_servers_latency_model(
    serve: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server: Server = serve(MLP)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256],
                        "data": [0.0] * 256}]}
    with server.client() as client:
        for _ in range(20):
            assert client.post("/v2/models/mlp/infer", json=body).status_code == 200

        def published() -> bool:
            return gauge(client.get("/metrics").text, plan_cli.INTERCEPT) > 0.0

        wait_for(published, 30, "the runner's latency model in /metrics")
        text = client.get("/metrics").text
    intercept_ms = gauge(text, plan_cli.INTERCEPT) * 1000.0
    slope_ms = gauge(text, plan_cli.SLOPE) * 1000.0
    assert plan_cli.metrics_fit(server.url, "mlp") == pytest.approx((intercept_ms, slope_ms))
    code, out, _ = run(["--metrics", server.url, "--config", str(write_config(tmp_path)),
                        "--rate", "200", "--processes", "1", "--seconds", "1", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["cost"] == f"CPU {intercept_ms:.3g} ms + {slope_ms:.3g} ms/row, noise 0.1"
    assert report["settings"][0]["passing_rps"] > 200.0
