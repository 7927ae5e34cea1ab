"""A pipeline on the virtual clock: its steps in turn, under one deadline.

`batchserve simulate SCENARIO.yml --pipeline NAME [--config PATH]`. The configuration gives
the pipeline's steps and limit, and each runner's batching and processes (`workers`); the
scenario gives the traffic and each runner's cost (`runners`, by default its `cost`). Every
process of a step's runner runs the policy a runner process runs (`build_policy`), on its own
model, and a runner used by two steps is one set of processes, as it is live.

A request is judged as an API worker judges it (`batchserve.runner.policy.chain`): refused at
the entrance when the steps' predicted times add up past the limit, naming the step that
weighs most; else each step is offered, on a process picked at random (`choice: random`), with
what is left of the deadline less the later steps' predicted time, and its answer goes on to
the next step at once. A step's predicted time is what its most hopeful process's policy
would promise a one-row request now (`Policy.admission`), never less than a one-row batch on
its idle model. Left out: the API worker's own time and the crossings, and the age of the
backlogs a worker knows: the simulated one hears each policy's word the moment it changes.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..core.config import Config
from ..core.runner_config import RunnerConfig
from ..policy.base import Batch, Policy, Request
from ..policy.chain import heaviest, refuses, step_budget_s
from ..policy.policies import build_policy
from .batch_times import BatchTimer
from .scenario import Cost, Scenario
from .trace import (
    CostClock,
    Trace,
    arrivals,
    batch_answered,
    calibrate,
    percentile,
    refit,
    start_batch,
)

__all__ = ["PipelineResult", "Station", "StepResult", "simulate_pipeline", "stations"]


@dataclass(frozen=True, slots=True)
class Station:
    """A step's runner as simulated: its configuration (batching, `workers` processes) and its
    cost in each phase of the scenario."""

    runner: RunnerConfig
    costs: tuple[Cost, ...]


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step: its 503s (refused by its runner, or its share of the deadline spent), the
    requests refused at the entrance with this step weighing most, and its runner's batches
    and the time a call took from being offered to its batch's end (a runner used by two
    steps shows its batches and times for both)."""

    runner: str
    processes: int
    max_batch_size: int
    refused: int
    refused_at_entrance: int
    batches: int
    mean_batch_size: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """What one run of a pipeline measured, end to end and by step."""

    scenario: str
    pipeline: str
    seconds: float
    limit_ms: float
    requests: int
    ok: int
    rejected: int
    late: int
    goodput_rps: float
    p50_ms: float
    p99_ms: float
    rejected_at_entrance: int
    steps: tuple[StepResult, ...]
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True, eq=False)
class _Process:
    """One runner process: its policy, its model's batch times, what it ran."""

    policy: Policy
    costs: CostClock
    timer: BatchTimer
    trace: Trace = field(default_factory=Trace)
    running: Batch | None = None
    started: float = math.inf
    done_at: float = math.inf
    wake: float = math.inf
    cpu_s: float = 0.0

    @property
    def next_at(self) -> float:
        return min(self.done_at, self.wake)

    def predicted_s(self, now: float) -> float:
        """A one-row request's time offered now, as the chain counts it for this process."""
        return max(self.policy.admission(now).wait_s, self.policy.idle_time_s(1))


class _Chain:
    """The run: every process of every runner, and each request's way through the steps."""

    def __init__(self, scenario: Scenario, stations: Sequence[Station], seed: int,
                 times: Sequence[float]) -> None:
        self.limit_s = scenario.slo_ms / 1000.0
        by_runner: dict[str, list[_Process]] = {}
        for station in stations:
            name = station.runner.name
            if name not in by_runner:
                by_runner[name] = [self._process(scenario, station, seed, i, times)
                                   for i in range(station.runner.workers)]
        self.steps = [by_runner[station.runner.name] for station in stations]
        self.processes = [process for group in by_runner.values() for process in group]
        self.choice = random.Random(f"{seed}/choice")
        self.entered: list[float] = []
        self.at_step: list[int] = []
        self.latencies: list[float] = []
        self.late = 0
        self.refused: Counter[int] = Counter()
        self.at_entrance: Counter[int] = Counter()

    @staticmethod
    def _process(scenario: Scenario, station: Station, seed: int, index: int,
                 times: Sequence[float]) -> _Process:
        name = station.runner.name
        noise = random.Random(f"{seed}/{name}/{index}/cost")
        machine = random.Random(f"{seed}/{name}/{index}/machine")
        policy = build_policy(station.runner)
        calibrate(policy, station.costs[0], noise, machine)
        phases = [replace(phase, cost=cost) for phase, cost in zip(scenario.phases,
                                                                    station.costs, strict=True)]
        return _Process(policy, CostClock(phases), BatchTimer(noise, machine, times))

    def run(self, traffic: Sequence[tuple[float, int]]) -> None:
        index, count = 0, len(traffic)
        while True:
            arrival = traffic[index][0] if index < count else math.inf
            process = min(self.processes, key=_next_at)
            now = min(arrival, process.next_at)
            if now == math.inf:
                return
            if process.done_at == now:
                self._complete(process, now)
            elif arrival == now:
                self._arrive(index, traffic[index][1], now)
                index += 1
            else:
                process.wake = math.inf
                self._poll(process, now)

    def predicted(self, now: float) -> tuple[float, ...]:
        """Each step's time, by its most hopeful process (an API worker's least backlog)."""
        return tuple(min(process.predicted_s(now) for process in step) for step in self.steps)

    def _arrive(self, ident: int, rows: int, now: float) -> None:
        self.entered.append(now)
        self.at_step.append(0)
        predicted = self.predicted(now)
        if refuses(predicted, self.limit_s):
            self.at_entrance[heaviest(predicted)] += 1
            return
        process = self._offer(0, ident, rows, now, predicted)
        if process is not None:
            self._poll(process, now)

    def _offer(self, step: int, ident: int, rows: int, now: float,
               predicted: Sequence[float]) -> _Process | None:
        """Send a request's call to a process of `step`; None when it is refused."""
        self.at_step[ident] = step
        left_s = self.entered[ident] + self.limit_s - now
        budget_s = step_budget_s(left_s, predicted, step)
        if budget_s <= 0.0:
            self.refused[step] += 1
            return None
        group = self.steps[step]
        process = group[self.choice.randrange(len(group))] if len(group) > 1 else group[0]
        request = Request(ident, rows, now, now + budget_s)
        if not process.policy.offer(request, now):
            process.trace.refusals.append((request, now))
            self.refused[step] += 1
            return None
        return process

    def _complete(self, process: _Process, now: float) -> None:
        """A batch ends: its calls go on to their next steps, all offered before any poll."""
        batch = process.running
        assert batch is not None
        process.policy.complete(batch, process.started, now, process.cpu_s)
        batch_answered(process.trace, batch, now)
        process.running, process.done_at = None, math.inf
        refit(process.policy, now, process.trace)
        last = len(self.steps) - 1
        predicted: tuple[float, ...] = ()
        touched: list[_Process] = []
        for request in batch.requests:
            step = self.at_step[request.id]
            if step == last:
                self._done(request.id, now)
                continue
            predicted = predicted or self.predicted(now)
            target = self._offer(step + 1, request.id, request.rows, now, predicted)
            if target is not None and target is not process and target not in touched:
                touched.append(target)
        for polled in (process, *touched):
            self._poll(polled, now)

    def _done(self, ident: int, now: float) -> None:
        entered = self.entered[ident]
        self.latencies.append(now - entered)
        if now > entered + self.limit_s:
            self.late += 1

    def _poll(self, process: _Process, now: float) -> None:
        step = process.policy.poll(now)
        for request in (*step.expired, *step.refused):
            process.trace.refusals.append((request, now))
            self.refused[self.at_step[request.id]] += 1
        if step.batch is not None:
            if process.running is not None:
                raise RuntimeError("the policy released a batch while one was running")
            process.running, process.started = step.batch, now
            taken = start_batch(process.trace, process.timer, process.costs, step.batch, now)
            process.cpu_s, process.done_at = taken.cpu_s, now + taken.wall_s
        process.wake = math.inf if step.wake_at is None else max(step.wake_at, now + 1e-6)


def _next_at(process: _Process) -> float:
    return process.next_at


def stations(config: Config, name: str, scenario: Scenario, where: str
             ) -> tuple[Scenario, list[Station]]:
    """Pipeline `name` of `config` (read from `where`) as simulated on `scenario`: the
    scenario within the pipeline's limit, and its steps' stations."""
    if name not in config.pipelines:
        known = ", ".join(config.pipelines) or "it has none"
        raise ValueError(f"--pipeline has value {name!r}; it must be a pipeline of {where} "
                         f"({known})")
    pipeline = config.pipelines[name]
    for runner, _ in scenario.runners:
        if runner not in pipeline.runners:
            raise ValueError(f"{scenario.name}.runners.{runner} is not a runner of pipeline "
                             f"{name!r}; its runners are: {', '.join(pipeline.runners)}")
    steps = [Station(config.runners[step.runner], scenario.costs_of(step.runner))
             for step in pipeline.steps]
    return replace(scenario, slo_ms=pipeline.max_latency_ms), steps


def simulate_pipeline(scenario: Scenario, pipeline: str, stations: Sequence[Station], *,
                      seed: int | None = None,
                      traffic: list[tuple[float, int]] | None = None) -> PipelineResult:
    """Run a pipeline, `stations` its steps in order, through the scenario's traffic (or
    `traffic`, arrival times with request sizes) within the scenario's `slo_ms`."""
    seed = scenario.seed if seed is None else seed
    wall = time.perf_counter()
    traffic = arrivals(scenario, seed) if traffic is None else traffic
    run = _Chain(scenario, stations, seed, [arrival for arrival, _ in traffic])
    run.run(traffic)
    return _result(scenario, pipeline, stations, run, time.perf_counter() - wall)


def _result(scenario: Scenario, pipeline: str, stations: Sequence[Station], run: _Chain,
            wall_s: float) -> PipelineResult:
    ok = len(run.latencies)
    entrance = sum(run.at_entrance.values())
    rejected = entrance + sum(run.refused.values())
    steps = tuple(_step(index, station, run) for index, station in enumerate(stations))
    return PipelineResult(
        scenario=scenario.name, pipeline=pipeline, seconds=scenario.seconds,
        limit_ms=scenario.slo_ms, requests=ok + rejected, ok=ok, rejected=rejected,
        late=run.late, goodput_rps=(ok - run.late) / scenario.seconds,
        p50_ms=percentile(run.latencies, 0.50) * 1000.0,
        p99_ms=percentile(run.latencies, 0.99) * 1000.0,
        rejected_at_entrance=entrance, steps=steps, wall_s=wall_s,
    )


def _step(index: int, station: Station, run: _Chain) -> StepResult:
    traces = [process.trace for process in run.steps[index]]
    batches = sum(len(trace.batch_starts) for trace in traces)
    rows = sum(rows for trace in traces for _, rows, _ in trace.batch_info)
    latencies = [latency for trace in traces for latency in trace.latencies]
    return StepResult(
        runner=station.runner.name, processes=len(traces),
        max_batch_size=station.runner.batching.max_batch_size,
        refused=run.refused[index], refused_at_entrance=run.at_entrance[index],
        batches=batches, mean_batch_size=rows / batches if batches else 0.0,
        p99_ms=percentile(latencies, 0.99) * 1000.0,
    )


def describe(result: PipelineResult) -> str:
    """The run in a few lines and a table of its steps."""
    share = 100.0 / result.requests if result.requests else 0.0
    lines = [
        f"{result.scenario} · pipeline {result.pipeline} · limit {result.limit_ms:g} ms · "
        f"{result.seconds:g} s simulated",
        f"requests {result.requests}  ok {result.ok}  rejected {result.rejected} "
        f"({result.rejected * share:.2f}%; {result.rejected_at_entrance} at the entrance)  "
        f"late {result.late} ({result.late * share:.2f}%)",
        f"goodput {result.goodput_rps:.1f} req/s  p50 {result.p50_ms:.2f} ms  "
        f"p99 {result.p99_ms:.2f} ms  wall {result.wall_s:.2f} s",
        "",
        "| step | runner | processes | max_batch_size | refused at the entrance | refused "
        "by the step | batches | mean batch | step p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {i} | {s.runner} | {s.processes} | {s.max_batch_size} | "
              f"{s.refused_at_entrance} | {s.refused} | {s.batches} | "
              f"{s.mean_batch_size:.1f} | {s.p99_ms:.2f} |"
              for i, s in enumerate(result.steps)]
    return "\n".join(lines)
