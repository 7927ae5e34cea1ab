"""Serving a pipeline: one request carried step by step through the runners it chains.

The API worker carries the chain, not the runners: a request is decoded against the
pipeline's own signature, its tensors sent to the first step's runner as an ordinary call,
and each answer's outputs (the raw arrays read from the wire) sent on as the next step's
call, until the last step's outputs are the answer. Runners never learn they are steps, and
every step takes the same road as a request for its runner alone: the runner's pool, its
choice of process, its published backlog, its failures as the same errors. The cost is one
more crossing per step; the gain, runners that need no word of each other (see
docs/architecture.md, "Pipelines").

The pipeline has one deadline (`batchserve.runner.policy.chain`, on the steps' times as
`batchserve.api.chain` predicts them): a request whose steps would not fit it is refused at
the entrance (503, reason `pipeline`), each step is sent with what is left less the later
steps' predicted time, and a step refused or failed ends the request at once:
no later step runs, and the answer is that step's error, its message naming the step.
Refusals are counted by step (its position and runner) in
`batchserve_pipeline_refusals_total`, and the rows each step ran for requests that then ended
refused, failed or late in `batchserve_pipeline_wasted_rows_total`: the compute the one
deadline is there to save.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from prometheus_client import Counter

from ..runner.core.config import RunnerConfig
from ..runner.core.pipeline import PipelineConfig, Step
from ..runner.core.retry import retry_after_s
from ..runner.core.signature import SignatureError
from ..runner.core.timeouts import Timeouts
from ..runner.core.types import Tensors
from ..runner.policy.chain import heaviest, refuses, step_budget_s
from . import protocol
from .backlog import Published
from .chain import predict
from .dispatch import Pool
from .errors import BacklogRefused, BadRequest, BatchserveError, PipelineRefused, Unavailable
from .failures import outputs_of
from .overload import Gate

__all__ = ["Chain", "Host", "Route", "pipeline_refusals", "pipeline_wasted_rows"]

pipeline_refusals = Counter(
    "batchserve_pipeline_refusals_total",
    "Pipeline requests refused (503), by the step that refused or weighed most",
    ["pipeline", "step", "runner"],
)


def count_refusal(pipeline: str, index: int, runner: str, by: float = 1.0) -> None:
    """Count a refusal of step `index` (its position, from 0) of `pipeline`: a runner used
    twice in one chain is two steps, counted apart. `by` 0 makes the series exist."""
    pipeline_refusals.labels(pipeline, str(index), runner).inc(by)


pipeline_wasted_rows = Counter(
    "batchserve_pipeline_wasted_rows_total",
    "Rows a pipeline's step ran for requests that a later step then refused or failed, or "
    "that were answered past their limit",
    ["pipeline", "step", "runner"],
)

_NOT_LOAD = frozenset({"draining", "unreachable"})
"""The 503 reasons of a step that say nothing of the chain's load: its process stopping,
restarting or out of reach. The next request may find another process, or this one back."""


class Host(Protocol):
    """The exchange a chain answers through: its one answer, outputs or an error."""

    @property
    def done(self) -> bool: ...

    def deliver(self, outputs: Tensors, rows: int, spare_s: float) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


@dataclass(slots=True)
class Route:
    """A pipeline and what its steps are sent with in one API worker: the runners' pools,
    their gates, the count of calls out to each."""

    pipeline: PipelineConfig
    runners: Mapping[str, RunnerConfig]
    pools: Mapping[str, Pool]
    gates: Mapping[str, Gate]
    waiting: dict[str, int]
    timeouts: Timeouts

    def __post_init__(self) -> None:
        for index, step in enumerate(self.pipeline.steps):  # every series reads 0 from the start
            count_refusal(self.pipeline.name, index, step.runner, 0.0)
            pipeline_wasted_rows.labels(self.pipeline.name, str(index), step.runner)

    def backlogs(self, now: float) -> list[Published | None]:
        """Each step's most hopeful process's published backlog, as judged at `now`."""
        return [self.pools[step.runner].least_backlog(now) for step in self.pipeline.steps]

    def judge(self, budget_s: float, now: float, rows: float | None) -> None:
        """Refuse at the entrance a request whose steps would not fit `budget_s` (`rows`:
        the request's, or None before they are known)."""
        backlogs = self.backlogs(now)
        predicted = predict(backlogs, now)
        if not refuses(predicted, budget_s):
            return
        worst = heaviest(predicted)
        backlog = backlogs[worst]
        if backlog is None:
            retry = retry_after_s(0.0)
        else:
            retry = retry_after_s(backlog.refuse(
                backlog.word.request_rows if rows is None else rows))
        runner = self.pipeline.steps[worst].runner
        count_refusal(self.pipeline.name, worst, runner)
        raise PipelineRefused(self.pipeline.name, worst, runner, retry, {
            "predicted_ms": round(sum(predicted) * 1000, 1),
            "deadline_ms": round(budget_s * 1000, 1), "step": worst})

    def chain(self, host: Host) -> Chain:
        return Chain(self, host)


class Chain:
    """One request's way through the steps: the tensors known so far, the step now out."""

    __slots__ = ("route", "host", "tensors", "deadline", "due", "index", "rows", "group",
                 "ran")

    def __init__(self, route: Route, host: Host) -> None:
        self.route, self.host = route, host
        self.tensors: dict[str, np.ndarray] = {}
        self.deadline = self.due = 0.0
        self.index = self.rows = 0
        self.group: tuple[str, ...] = ()
        self.ran: list[int] = []  # the rows each step answered so far ran

    @property
    def step(self) -> Step:
        return self.route.pipeline.steps[self.index]

    def start(self, inputs: Tensors, rows: int, deadline: float, group: tuple[str, ...] = (),
              *, due: float | None = None) -> None:
        """Judge the decoded request again, on its own budget, then send the first step.
        `group` holds the request's values of the pipeline's `group_by` parameters: each step
        is sent with its runner's, as a request for that runner alone would be. `deadline` is
        what the steps share; `due`, when the answer is late (the request's arrival plus its
        limit, past the reserve kept for the way home; `deadline` if not given)."""
        self.tensors = dict(inputs)
        self.deadline = deadline
        self.due = deadline if due is None else due
        self.group = group
        now = time.monotonic()
        self.route.judge(deadline - now, now, rows)
        self._send()

    def _send(self) -> None:
        """Send the current step with what is left of the deadline less the later steps."""
        try:
            route, step = self.route, self.step
            runner = route.runners[step.runner]
            inputs = {name: self.tensors[source] for name, source in step.inputs}
            rows = self._rows(runner, inputs)
            now = time.monotonic()
            predicted = predict(route.backlogs(now), now)
            budget_s = step_budget_s(self.deadline - now, predicted, self.index)
            pool = route.pools[runner.name]
            link = pool.pick()
            if budget_s <= 0 or link.backlog.refuses(budget_s, now):
                raise self._refused(link.backlog, budget_s, rows, now)
            wait_s = runner.batch_timeout_s + route.timeouts.call_slack_s
            group = route.pipeline.group_of(runner, self.group)
            pool.submit(inputs, rows, budget_s, group, wait_s, self._answered, 0.0, link)
            route.waiting[runner.name] += 1
            self.rows = rows
        except Exception as exc:
            self._fail(exc)

    def _rows(self, runner: RunnerConfig, inputs: Mapping[str, np.ndarray]) -> int:
        """The step's row count, by its runner's signature (a sequence an earlier step made
        may be too long for this runner: the request's fault, a 400)."""
        try:
            return protocol.signature_of(runner).inputs.rows(inputs)
        except SignatureError as exc:
            raise BadRequest(str(exc)) from None

    def _refused(self, backlog: Published, budget_s: float, rows: int, now: float
                 ) -> Unavailable:
        """The step's refusal on its process's backlog, or on a deadline already spent."""
        if budget_s <= 0:
            return Unavailable(
                "what is left of the request's deadline would not cover this step and the "
                "steps after it; retry later", 1.0, "pipeline",
                {"deadline_ms": round(budget_s * 1000, 1), "step": self.index})
        return BacklogRefused(self.step.runner, retry_after_s(backlog.refuse(rows)), {
            "predicted_ms": round(backlog.left_s(now) * 1000, 1),
            "deadline_ms": round(budget_s * 1000, 1), "rows_ahead": backlog.word.rows_ahead})

    def _answered(self, outcome: Tensors | Exception, spare_s: float) -> None:
        """A step's answer: on to the next step, or the request's answer; else its error."""
        route, step = self.route, self.step
        try:
            outputs = outputs_of(step.runner, outcome, route.waiting, route.gates[step.runner])
            if self.host.done:  # answered already (the server stopped meanwhile)
                return
            for name, target in step.outputs:
                self.tensors[target] = outputs[name]
        except Exception as exc:
            if not self.host.done:
                self._fail(exc)
            return
        self.ran.append(self.rows)
        self.index += 1
        if self.index < len(route.pipeline.steps):
            self._send()
            return
        if time.monotonic() > self.due:
            self._wasted()
        outputs = {spec.name: self.tensors[spec.name] for spec in route.pipeline.facade.outputs}
        # The rows the last step was called with; its deadline was the request's own.
        self.host.deliver(outputs, self.rows, spare_s)

    def _wasted(self) -> None:
        """Count the rows the steps answered so far ran for nothing: the request ends
        refused, failed or late."""
        name, steps = self.route.pipeline.name, self.route.pipeline.steps
        for index, (step, rows) in enumerate(zip(steps, self.ran, strict=False)):
            pipeline_wasted_rows.labels(name, str(index), step.runner).inc(rows)

    def _fail(self, exc: BaseException) -> None:
        """End the request with the step's error, its message naming the step."""
        name, step = self.route.pipeline.name, self.step
        self._wasted()
        if isinstance(exc, BatchserveError):
            exc.message = (f"pipeline {name!r}, step {self.index} (runner {step.runner!r}): "
                           f"{exc.message}")
            exc.args = (exc.message,)
            if exc.status == 503:
                count_refusal(name, self.index, step.runner)
                if getattr(exc, "reason", "") not in _NOT_LOAD:
                    # The entrance turns away the share its steps refuse for want of time,
                    # before any step runs.
                    self.route.gates[name].refused(time.monotonic())
        self.host.fail(exc)
