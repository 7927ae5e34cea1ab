"""A pipeline's one deadline, on made-up backlogs and a clock the test sets: the entrance
refuses what a later step's queue would make late, each step gets what is left less the steps
after it, and a step's refusal ends the request before the next step is sent."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from batchserve.api import chain
from batchserve.api.backlog import Published
from batchserve.api.dispatch import RunnerFailure
from batchserve.api.errors import PipelineRefused, SloRefused, Unavailable
from batchserve.api.overload import ENGAGED, Gate
from batchserve.api.pipeline import Route
from batchserve.runner.core.config import parse
from batchserve.runner.core.timeouts import Timeouts
from batchserve.runner.core.types import Tensors
from batchserve.runner.core.wire import Backlog, Failure, FailureCode
from batchserve.runner.policy import chain as deadline

CONFIG_RUNNERS = {
    "first": {"model": "m:f", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
              "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]},
    "second": {"model": "m:s", "inputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
               "outputs": [{"name": "z", "datatype": "FP32", "shape": [-1, 2]}]},
}
CONFIG = parse({
    "runners": CONFIG_RUNNERS,
    "pipelines": {"chain": {"max_latency_ms": 100,
                            "steps": [{"runner": "first"}, {"runner": "second"}]}},
})


def heard(wait_s: float, at: float, least_s: float | None = None) -> Published:
    """A process's backlog as published at `at`; first its idle time, if given."""
    published = Published()
    if least_s is not None:
        published.hear(Backlog(least_s), at)
    published.hear(Backlog(wait_s, rows_ahead=5, drain_s=wait_s), at)
    return published


def test_a_step_counts_what_is_left_of_its_backlog_and_never_less_than_idle() -> None:
    published = heard(0.300, at=10.0, least_s=0.004)
    assert published.expected_s(10.100) == pytest.approx(0.200)
    assert published.expected_s(11.0) == pytest.approx(0.004)  # drained: its idle time
    assert Published().expected_s(0.0) == 0.0  # never heard: nothing known


def test_the_entrance_refuses_when_a_later_step_is_saturated() -> None:
    predicted = chain.predict([heard(0.004, 0.0), heard(0.300, 0.0, 0.010)], now=0.050)
    assert predicted == pytest.approx((0.004, 0.250))
    assert deadline.refuses(predicted, budget_s=0.100)
    assert deadline.heaviest(predicted) == 1
    assert not deadline.refuses(chain.predict([heard(0.004, 0.0), heard(0.030, 0.0)], 0.0), 0.100)


def test_each_step_gets_what_is_left_less_the_steps_after_it() -> None:
    predicted = (0.010, 0.020, 0.030)
    assert deadline.step_budget_s(0.100, predicted, 0) == pytest.approx(0.050)
    assert deadline.step_budget_s(0.070, predicted, 1) == pytest.approx(0.040)
    assert deadline.step_budget_s(0.040, predicted, 2) == pytest.approx(0.040)


# --- the chain over stand-in pools, answered by the test --------------------------------------


@dataclass
class Link:
    backlog: Published


@dataclass
class StubPool:
    """A runner's pool: its one process's backlog, and the calls sent to it, kept for the
    test to answer."""

    backlog: Published = field(default_factory=Published)
    sent: list[tuple[Tensors, int, float, Any]] = field(default_factory=list)

    def least_backlog(self, now: float) -> Published:
        return self.backlog

    def pick(self) -> Link:
        return Link(self.backlog)

    def submit(self, tensors: Tensors, rows: int, budget_s: float, group: tuple[str, ...],
               wait_s: float, done: Any, spent_s: float, link: Any) -> None:
        self.sent.append((tensors, rows, budget_s, done))


@dataclass
class Host:
    done: bool = False
    answer: Any = None

    def deliver(self, outputs: Tensors, rows: int, spare_s: float) -> None:
        self.done, self.answer = True, (outputs, rows)

    def fail(self, exc: BaseException) -> None:
        self.done, self.answer = True, exc


@pytest.fixture
def pools() -> dict[str, StubPool]:
    return {"first": StubPool(), "second": StubPool()}


def route(pools: dict[str, StubPool], gates: dict[str, Gate] | None = None) -> Route:
    """The pipeline `chain` over stub pools, with a gate for each runner and for itself."""
    gates = {name: Gate() for name in (*pools, "chain")} if gates is None else gates
    return Route(CONFIG.pipelines["chain"], CONFIG.runners, pools,  # type: ignore[arg-type]
                 gates, dict.fromkeys(pools, 0), Timeouts())


def test_the_route_refuses_at_the_entrance_naming_the_heaviest_step(
        pools: dict[str, StubPool]) -> None:
    pools["second"].backlog = heard(0.500, at=0.0)
    with pytest.raises(PipelineRefused) as info:
        route(pools).judge(0.100, now=0.100, rows=1)
    assert info.value.reason == "pipeline"
    assert info.value.details["step"] == 1
    assert "step 1, runner 'second'" in info.value.message
    assert pools["first"].sent == [] and pools["second"].sent == []


def test_a_step_is_sent_with_the_deadline_less_the_steps_after_it(
        pools: dict[str, StubPool], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("batchserve.api.pipeline.time.monotonic", lambda: clock[0])
    pools["second"].backlog = heard(0.030, at=100.0)
    host = Host()
    x = np.ones((3, 2), np.float32)
    route(pools).chain(host).start({"x": x}, 3, deadline=100.100)
    (tensors, rows, budget_s, done), = pools["first"].sent
    assert rows == 3 and tensors["x"] is x
    assert budget_s == pytest.approx(0.100 - 0.030)
    clock[0] = 100.050  # step one answers 50 ms later: the second step gets what is left
    y = 2 * x
    done({"y": y}, 0.0)
    (tensors, rows, budget_s, done), = pools["second"].sent
    assert tensors["y"] is y and budget_s == pytest.approx(0.050)
    done({"z": 3 * x}, 0.0)
    outputs, rows = host.answer
    assert rows == 3 and np.array_equal(outputs["z"], 3 * x)


def test_a_step_refused_ends_the_request_before_the_next_is_sent(
        pools: dict[str, StubPool]) -> None:
    host = Host()
    route(pools).chain(host).start({"x": np.ones((1, 2), np.float32)}, 1, deadline=math.inf)
    (_, _, _, done), = pools["first"].sent
    done(RunnerFailure(Failure(1, FailureCode.REFUSED, "refused", 2.0)), 0.0)
    assert isinstance(host.answer, SloRefused) and host.answer.status == 503
    assert host.answer.message.startswith("pipeline 'chain', step 0 (runner 'first'): ")
    assert pools["second"].sent == []


def test_each_step_refusal_raises_the_share_the_pipeline_turns_away_at_its_entrance(
        pools: dict[str, StubPool], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step refusing after the steps before it ran wastes their work: the pipeline's own
    gate learns the share its steps refuse, so the entrance turns it away before any step."""
    monkeypatch.setattr("batchserve.api.pipeline.time.monotonic", lambda: 5.0)
    step = Gate().step
    gates = {name: Gate() for name in (*pools, "chain")}
    chained = route(pools, gates)
    for ident in range(10):
        chained.chain(Host()).start({"x": np.ones((1, 2), np.float32)}, 1, deadline=math.inf)
        pools["first"].sent.pop()[3]({"y": np.ones((1, 2), np.float32)}, 0.0)
        pools["second"].sent.pop()[3](
            RunnerFailure(Failure(ident, FailureCode.REFUSED, "refused", 1.0)), 0.0)
    assert gates["chain"].share == pytest.approx(1 - (1 - step) ** 10)
    assert gates["chain"].shares(5.0) > ENGAGED  # the front sheds now
    chained.chain(Host()).start({"x": np.ones((1, 2), np.float32)}, 1, deadline=math.inf)
    pools["first"].sent.pop()[3]({"y": np.ones((1, 2), np.float32)}, 0.0)
    pools["second"].sent.pop()[3]({"z": np.ones((1, 2), np.float32)}, 0.0)
    assert gates["chain"].share == pytest.approx(1 - (1 - step) ** 10)


def test_a_step_whose_process_is_down_or_draining_leaves_the_entrance_open(
        pools: dict[str, StubPool], monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a step short of time says the chain is offered more than it carries: a step's
    process restarting or draining answers 503 too, and another process, or the same one
    restarted, takes the next request, so the entrance must not turn it away."""
    monkeypatch.setattr("batchserve.api.pipeline.time.monotonic", lambda: 5.0)
    gates = {name: Gate() for name in (*pools, "chain")}
    chained = route(pools, gates)
    for ident in range(10):
        host = Host()
        chained.chain(host).start({"x": np.ones((1, 2), np.float32)}, 1, deadline=math.inf)
        pools["first"].sent.pop()[3]({"y": np.ones((1, 2), np.float32)}, 0.0)
        pools["second"].sent.pop()[3](
            RunnerFailure(Failure(ident, FailureCode.STOPPING, "stopping", 1.0)), 0.0)
        assert isinstance(host.answer, Unavailable) and host.answer.reason == "draining"
    assert gates["chain"].share == 0.0


def test_a_step_whose_share_of_the_deadline_is_spent_is_not_sent(
        pools: dict[str, StubPool], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("batchserve.api.pipeline.time.monotonic", lambda: clock[0])
    host = Host()
    route(pools).chain(host).start({"x": np.ones((1, 2), np.float32)}, 1, deadline=0.100)
    (_, _, _, done), = pools["first"].sent
    clock[0] = 0.150  # the first step answered past the whole deadline
    done({"y": np.ones((1, 2), np.float32)}, 0.0)
    assert isinstance(host.answer, Unavailable) and host.answer.reason == "pipeline"
    assert host.answer.message.startswith(
        "pipeline 'chain', step 1 (runner 'second'): what is left of the request's deadline "
        "would not cover this step")
    assert pools["second"].sent == []


def test_a_runner_used_twice_is_counted_as_two_steps() -> None:
    """`first` twice: a refusal of its second use counts under step 1, not step 0."""
    config = parse({
        "runners": CONFIG_RUNNERS,
        "pipelines": {"again": {"max_latency_ms": 100, "steps": [
            {"runner": "first"},
            {"runner": "first", "input_map": {"x": "y"}, "output_map": {"y": "twice"}}]}},
    })
    pools = {"first": StubPool()}
    host = Host()
    again = Route(config.pipelines["again"], config.runners, pools,  # type: ignore[arg-type]
                  {"first": Gate(), "again": Gate()}, {"first": 0}, Timeouts())
    before = {step: refusals("again", step) for step in ("0", "1")}
    again.chain(host).start({"x": np.ones((1, 2), np.float32)}, 1, deadline=math.inf)
    pools["first"].sent[0][3]({"y": np.ones((1, 2), np.float32)}, 0.0)
    pools["first"].sent[1][3](RunnerFailure(Failure(2, FailureCode.REFUSED, "refused", 1.0)),
                              0.0)
    assert isinstance(host.answer, SloRefused)
    assert refusals("again", "1") - before["1"] == 1
    assert refusals("again", "0") - before["0"] == 0


def refusals(pipeline: str, step: str) -> float:
    value = REGISTRY.get_sample_value("batchserve_pipeline_refusals_total",
                                      {"pipeline": pipeline, "step": step, "runner": "first"})
    assert value is not None, f"no series for step {step}"
    return value


def wasted(step: str, runner: str) -> float:
    value = REGISTRY.get_sample_value("batchserve_pipeline_wasted_rows_total",
                                      {"pipeline": "chain", "step": step, "runner": runner})
    assert value is not None, f"no series for step {step}"
    return value


def test_rows_a_step_ran_for_a_request_a_later_step_refused_are_counted_wasted(
        pools: dict[str, StubPool]) -> None:
    host = Host()
    chained = route(pools)
    before = wasted("0", "first"), wasted("1", "second")
    chained.chain(host).start({"x": np.ones((3, 2), np.float32)}, 3, deadline=math.inf)
    (_, _, _, done), = pools["first"].sent
    done({"y": np.ones((3, 2), np.float32)}, 0.0)
    (_, _, _, done), = pools["second"].sent
    done(RunnerFailure(Failure(1, FailureCode.REFUSED, "refused", 2.0)), 0.0)
    assert isinstance(host.answer, SloRefused)
    assert (wasted("0", "first"), wasted("1", "second")) == (before[0] + 3, before[1])


def test_an_answer_past_the_limit_counts_every_step_wasted_and_one_in_time_none(
        pools: dict[str, StubPool], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("batchserve.api.pipeline.time.monotonic", lambda: clock[0])
    for answered_at, late in ((0.090, False), (0.130, True)):
        host = Host()
        clock[0] = 0.0
        chained = route(pools)
        before = wasted("0", "first"), wasted("1", "second")
        chained.chain(host).start({"x": np.ones((2, 2), np.float32)}, 2, deadline=0.080,
                                  due=0.100)
        pools["first"].sent.pop()[3]({"y": np.ones((2, 2), np.float32)}, 0.0)
        clock[0] = answered_at
        pools["second"].sent.pop()[3]({"z": np.ones((2, 2), np.float32)}, 0.0)
        assert isinstance(host.answer, tuple)  # answered, in time or not
        added = 2 if late else 0
        assert (wasted("0", "first"), wasted("1", "second")) == (before[0] + added,
                                                                 before[1] + added)
