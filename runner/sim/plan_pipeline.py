"""Capacity planning for a pipeline: the number of processes and `max_batch_size` of each step
(`batchserve plan --pipeline NAME`).

Each step is planned as one runner is (`batchserve.runner.sim.plan`), on its own cost curve,
at the pipeline's target rate (every request passes every step), with:

- a share of the pipeline's limit in proportion to the time of a full batch of its runner
  (its configured `max_batch_size`), the step that takes longest getting the most;
- the other steps' work on the same cores counted as busy (full batches of their runners'
  `max_batch_size` at the target rate, each step's crossing of the API worker as `front_s`);
  a load generator on the machine is counted once, with the first step.

Then the chain is simulated at the target with each step's recommended setting (its largest
tried where none passes), as `batchserve simulate --pipeline` plays it
(`batchserve.runner.sim.pipeline`): one deadline, refusals at the entrance, every process its
runner's policy, batch times stretched by the machine's demand. Its p99 adds each step's
front time and the load generator's wait, as a runner's plan does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..core.pipeline import PipelineConfig
from ..core.runner_config import RunnerConfig
from .pipeline import PipelineResult, Station, simulate_pipeline
from .plan import (
    MAX_FAILED,
    Inputs,
    Machine,
    Setting,
    SettingPlan,
    Traffic,
    phase_demand,
    plan,
    recommend,
)
from .scenario import Contention, Cost, Phase, Scenario

__all__ = ["PipelinePlan", "StepPlan", "plan_pipeline"]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: its runner, what it was planned on (its share of the limit, the machine
    with the other steps' work) and each setting's plan."""

    runner: str
    inputs: Inputs
    plans: tuple[SettingPlan, ...]

    @property
    def chosen(self) -> SettingPlan:
        """The recommended setting, or the one that carries most where none passes."""
        best = recommend(self.plans)
        return best if best is not None else max(self.plans, key=lambda p: p.passing_rps)


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """Each step's plan, and the chain simulated with their settings at the target: its
    p99 of OK answers with the front's time, its share refused, and whether it passes."""

    pipeline: str
    limit_ms: float
    target: float
    steps: tuple[StepPlan, ...]
    chain: PipelineResult
    p99_ms: float
    refused: float

    @property
    def passed(self) -> bool:
        return self.p99_ms <= self.limit_ms and self.refused < MAX_FAILED

    def to_json(self) -> dict[str, Any]:
        def finite(value: Any) -> Any:
            return None if isinstance(value, float) and value == float("inf") else value

        return {
            "pipeline": self.pipeline, "limit_ms": self.limit_ms, "target_rps": self.target,
            "steps": [{
                "runner": step.runner, "limit_ms": step.inputs.limit_ms,
                "busy_cores": step.inputs.machine.busy_cores,
                "settings": [{**asdict(p.setting), "passing_rps": p.passing_rps,
                              "target": {k: finite(v) for k, v in asdict(p.target).items()}}
                             for p in step.plans],
                "recommended": (None if recommend(step.plans) is None
                                else asdict(step.chosen.setting)),
            } for step in self.steps],
            "chain": {"p99_ms": finite(self.p99_ms), "refused": self.refused,
                      "passed": self.passed, "simulated": self.chain.to_json()},
        }


def plan_pipeline(pipeline: PipelineConfig, runners: Mapping[str, RunnerConfig],
                  costs: Mapping[str, Cost], machine: Machine, traffic: Traffic,
                  target: float, settings: Sequence[Sequence[Setting]], *,
                  limit_ms: float | None = None, seed: int = 1) -> PipelinePlan:
    """Plan each step of `pipeline` (`settings[i]` the ones to try for step i, `costs` by
    runner), then simulate the chain at `target` with the settings chosen."""
    limit = pipeline.max_latency_ms if limit_ms is None else limit_ms
    own = [Inputs(costs[step.runner], _own(machine, i), traffic, limit, seed)
           for i, step in enumerate(pipeline.steps)]
    sizes = [runners[step.runner].batching.max_batch_size for step in pipeline.steps]
    full = [a + b * m for (a, b), m in
            ((inputs.cpu_line(), size) for inputs, size in zip(own, sizes, strict=True))]
    steps = []
    for i, step in enumerate(pipeline.steps):
        others = sum(phase_demand(own[j], target * traffic.rows, sizes[j])
                     for j in range(len(own)) if j != i)
        busy = replace(own[i].machine, busy_cores=own[i].machine.busy_cores + others)
        share = limit * full[i] / sum(full) if sum(full) > 0 else limit / len(full)
        inputs = replace(own[i], machine=busy, limit_ms=share)
        steps.append(StepPlan(step.runner, inputs, tuple(plan(inputs, settings[i], target))))
    return _checked(pipeline, runners, steps, own, traffic, target, limit, seed)


def _own(machine: Machine, index: int) -> Machine:
    """A step's own work on the machine: each step crosses the API worker (`front_s`); other
    work and a load generator are counted once, with the first step."""
    return machine if index == 0 else replace(machine, busy_cores=0.0, client_s=0.0)


def _checked(pipeline: PipelineConfig, runners: Mapping[str, RunnerConfig],
             steps: list[StepPlan], own: list[Inputs], traffic: Traffic, target: float,
             limit: float, seed: int) -> PipelinePlan:
    """The chain at the target, each step at its chosen setting and the machine's stretch."""
    shaped = traffic.at(target)
    chosen = [step.chosen for step in steps]
    phases, costs = [], [list[Cost]() for _ in steps]
    machine, stretch = own[0].machine, 1.0
    for seconds, rate in shaped.phases:
        demand = sum(phase_demand(inputs, rate * shaped.rows, plan.target.mean_batch)
                     for inputs, plan in zip(own, chosen, strict=True))
        slowdown = machine.stretch(demand)
        stretch = max(stretch, slowdown)
        # The batch timer counts the pipeline's arrivals: each step's batches slow down alike.
        per_krps = (slowdown - 1.0) / (rate / 1000.0) if rate > 0.0 else 0.0
        contention = Contention(per_krps) if 0.0 < per_krps < float("inf") else None
        for i, inputs in enumerate(own):
            costs[i].append(replace(inputs.cost, contention=contention))
        phases.append(Phase(seconds, rate, costs[0][-1]))
    stations = [Station(_configured(runners[step.runner], plan.setting), tuple(cost))
                for step, plan, cost in zip(pipeline.steps, chosen, costs, strict=True)]
    scenario = Scenario(name="plan", slo_ms=limit, max_batch_size=1, seed=seed,
                        size_min=shaped.rows, size_max=shaped.rows, phases=tuple(phases))
    result = simulate_pipeline(scenario, pipeline.name, stations,
                               traffic=shaped.share(1, seed))
    front_ms = machine.front_s * stretch * len(steps) * 1000.0
    p99_ms = result.p99_ms + front_ms + machine.client_wait_s(target, stretch) * 1000.0
    refused = result.rejected / result.requests if result.requests else 0.0
    if stretch == float("inf"):
        p99_ms, refused = float("inf"), 1.0
    return PipelinePlan(pipeline.name, limit, target, tuple(steps), result, p99_ms, refused)


def _configured(runner: RunnerConfig, setting: Setting) -> RunnerConfig:
    """The runner as it would be configured with `setting`."""
    batching = replace(runner.batching, max_batch_size=setting.max_batch_size)
    return replace(runner, workers=setting.processes, batching=batching)


def describe(result: PipelinePlan, cost_text: Sequence[str]) -> str:
    """Each step's settings as a table, its recommendation, and the chain at the target."""
    lines = [f"plan for pipeline {result.pipeline!r}: limit {result.limit_ms:g} ms, target "
             f"{result.target:.0f} req/s"]
    for i, (step, cost) in enumerate(zip(result.steps, cost_text, strict=True)):
        lines += [
            "",
            f"step {i} ({step.runner!r}): {step.inputs.limit_ms:.1f} ms of the limit; cost: "
            f"{cost}; other steps' work: {step.inputs.machine.busy_cores:.2f} cores",
            "| processes | max_batch_size | passing req/s | p99 ms at target "
            "| refused % at target | mean batch |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for p in step.plans:
            t = p.target
            p99 = "saturated" if t.saturated else f"{t.p99_ms:.1f}"
            lines.append(f"| {p.setting.processes} | {p.setting.max_batch_size} | "
                         f"{p.passing_rps:.0f} | {p99} | {t.refused * 100:.2f} | "
                         f"{t.mean_batch:.1f} |")
        best = recommend(step.plans)
        setting = step.chosen.setting
        lines.append(
            f"step {i} ({step.runner!r}): {setting.processes} process(es), max_batch_size "
            f"{setting.max_batch_size}" + ("" if best is not None else
                                           f" (none tried carries {result.target:.0f} req/s "
                                           "within its share; the most it carries)"))
    chain = result.chain
    p99 = "saturated" if result.p99_ms == float("inf") else f"{result.p99_ms:.1f} ms"
    lines += [
        "",
        f"the chain at {result.target:.0f} req/s with these settings: goodput "
        f"{chain.goodput_rps:.0f} req/s, p99 {p99}, refused {result.refused * 100:.2f}% "
        f"({chain.rejected_at_entrance} at the entrance); "
        + ("it passes" if result.passed else f"it does not pass within {result.limit_ms:g} ms"),
    ]
    return "\n".join(lines)
