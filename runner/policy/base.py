"""Batching policies: pure decisions over a request queue, driven by an injected clock.

A policy owns no socket, task or thread. The live dispatcher (`batchserve.runner.dispatcher`) and
the discrete-event simulator (`batchserve.runner.sim.simulate`) drive the very same object
through four calls:

    offer(request, now) -> bool         admit a request, or refuse it at once (HTTP 503);
                                        a request marked `assured` is always admitted
    poll(now) -> Step                   when the model is free, after an arrival, on a wake-up
    complete(batch, started, finished, cpu_s)  a released batch's measured wall and CPU time
    stats(now) -> PolicyStats           a snapshot for metrics

At most one batch is in flight: `poll` returns a batch only when the previous one completed.
Requests whose deadline passes while queued come back in `Step.expired` and are answered
without any compute spent on them (503; 413 for an assured one, too large for the limit).

`AdaptivePolicy` (in `batchserve.runner.policy.adaptive`) is the product, explained in
docs/dispatcher.md; `GreedyPolicy` and the baselines in `batchserve.runner.policy.baselines` are
what it is measured against. `batchserve.runner.policy.policies.make_policy` builds any of them by
name for the live runner and the simulator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .latency_model import Fit, Timing

Reason = Literal["idle", "full", "deadline", "window", "cap"]
"""Why a batch was released: the model was idle with work queued (`idle`), the batch reached
the cap (`full`), the oldest request could wait no longer (`deadline`), a waiting window ran
out (`window`), or the adaptive cap cut the batch (`cap`)."""


# Read-only by convention, not frozen: made for every request, and a frozen dataclass sets
# each field through object.__setattr__, five times the cost of a plain one.
@dataclass(slots=True)
class Request:
    """A queued request as a policy sees it: times are seconds on the injected clock."""

    id: int
    rows: int
    arrival: float
    deadline: float
    group: tuple[str, ...] = ()
    """The values of the runner's `group_by` parameters: only requests of one group share a
    batch. Empty for a runner that does not group."""
    assured: bool = False
    """A piece of a request that arrived at an idle model and fits it on the cost curve: the
    dispatcher admitted the whole request, so a policy takes every piece (see `offer`)."""


@dataclass(frozen=True, slots=True)
class Batch:
    """Requests released together, why, and the high-quantile time the policy predicted for
    them (0 for a policy without a latency model), so the prediction can be checked."""

    requests: tuple[Request, ...]
    reason: Reason
    predicted_s: float = field(default=0.0, compare=False)
    rows: int = field(init=False, compare=False)
    """Its requests' rows, summed once: every arrival while it runs is judged on them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", sum(request.rows for request in self.requests))


@dataclass(frozen=True, slots=True)
class Step:
    """What to do now: run `batch` (if any), refuse `expired` (their deadline passed, or
    their batch would surely end past it) and `refused` (let go before their deadline so
    that newer requests are served: `refuse: oldest`), and poll again by `wake_at`."""

    batch: Batch | None = None
    expired: tuple[Request, ...] = ()
    wake_at: float | None = None
    refused: tuple[Request, ...] = ()


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a policy refused a request, as it predicted: when the request would have finished
    (on the clock, at the high quantile) and how many rows were ahead of it; and in how many
    whole seconds its client should try again (0: the policy does not say)."""

    predicted_finish: float
    rows_ahead: int
    retry_after_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Admission:
    """What a one-row request offered now would be judged on: how long it is predicted to
    take (at the high quantile, as `offer` admits on; 0 where `offer` refuses nothing) and
    the rows ahead of it, queued and running; and what a refusal's Retry-After would cover:
    the time the rows ahead and the refused backlog need (`drain_s`) and each further
    refused row (`row_s`), and the rows a request holds lately (`request_rows`); and the most
    rows the next batch takes now (`next_rows`, 0 where it does not say)."""

    wait_s: float = 0.0
    rows_ahead: int = 0
    drain_s: float = 0.0
    row_s: float = 0.0
    request_rows: float = 1.0
    next_rows: int = 0


NO_ADMISSION = Admission()


@dataclass(frozen=True, slots=True)
class PolicyStats:
    window_s: float
    cap: int
    intercept_s: float
    slope_s: float
    p99_batch_s: float
    arrival_rps: float
    queued: int
    queue_wait_s: float = 0.0
    target_rows: float = 0.0
    spread: float = 0.0
    stretch: float = 1.0
    gap_s: float = 0.0
    fit: Fit | None = None
    """The latency model's current fit (None for a policy without one)."""


class Policy(Protocol):
    def offer(self, request: Request, now: float) -> bool: ...

    def poll(self, now: float) -> Step: ...

    def complete(
        self, batch: Batch, started: float, finished: float, cpu_s: float | None = None
    ) -> None:
        """The batch ran from `started` to `finished` on the clock, using `cpu_s` seconds of the
        model's CPU (None where the source cannot tell: taken as the wall time)."""
        ...

    def stats(self, now: float) -> PolicyStats: ...

    def calibration_sizes(self) -> tuple[int, ...]:
        """Batch sizes (rows) the runner times on synthetic rows before it reports ready."""
        ...

    def calibrate(self, timings: Sequence[Timing]) -> None:
        """The calibration batches, timed on synthetic rows."""
        ...

    def refit_job(self, now: float) -> Callable[[], Any] | None:
        """A pure closure over a snapshot of samples when a refit is due, else None.

        The live dispatcher runs it on a background thread and hands its result to
        `apply_fit` on the event loop; the simulator runs it inline.
        """
        ...

    def apply_fit(self, fit: Any) -> None: ...

    def idle_time_s(self, rows: int) -> float:
        """How long one batch of `rows` takes on an idle machine by the current cost curve
        (0 for a policy without a latency model): what a request needs at the very least."""
        ...

    def refusal(self) -> Refusal | None:
        """Why the last refused `offer` was refused (None for a policy that cannot say)."""
        ...

    def admission(self, now: float) -> Admission:
        """What a one-row request offered now would be judged on. Published with the
        runner's answers, it lets an API worker refuse in place what `offer` would refuse."""
        ...


def take_in_order(queue: deque[Request], cap: int) -> tuple[tuple[Request, ...], int]:
    """Pop the oldest request's group in arrival order while it fits `cap` rows (always at
    least one); requests of other groups keep their places."""
    group = queue[0].group
    taken: list[Request] = []
    passed: list[Request] = []
    rows = 0
    while queue:
        request = queue[0]
        if request.group != group:
            passed.append(queue.popleft())
            continue
        if taken and rows + request.rows > cap:
            break
        taken.append(queue.popleft())
        rows += request.rows
    queue.extendleft(reversed(passed))
    return tuple(taken), rows


class WithoutModel:
    """The calibration and refit part of the contract, for policies without a latency model."""

    def calibration_sizes(self) -> tuple[int, ...]:
        return ()

    def calibrate(self, timings: Sequence[Timing]) -> None:
        pass

    def refit_job(self, now: float) -> Callable[[], Any] | None:
        return None

    def apply_fit(self, fit: Any) -> None:
        pass

    def idle_time_s(self, rows: int) -> float:
        return 0.0

    def refusal(self) -> Refusal | None:
        return None

    def admission(self, now: float) -> Admission:
        return NO_ADMISSION


class GreedyPolicy(WithoutModel):
    """Release whatever is queued, up to the cap, as soon as the model is free.

    The floor every other policy is measured against: it never waits and never refuses
    early; it only drops requests whose deadline has already passed.
    """

    def __init__(self, max_batch_size: int) -> None:
        self.cap = max_batch_size
        self.queue: deque[Request] = deque()
        self.busy = False

    def offer(self, request: Request, now: float) -> bool:
        self.queue.append(request)
        return True

    def poll(self, now: float) -> Step:
        expired = []
        while self.queue and self.queue[0].deadline <= now:
            expired.append(self.queue.popleft())
        if self.busy or not self.queue:
            return Step(expired=tuple(expired))
        taken, rows = take_in_order(self.queue, self.cap)
        self.busy = True
        reason: Reason = "full" if rows >= self.cap else "idle"
        return Step(batch=Batch(taken, reason), expired=tuple(expired))

    def complete(
        self, batch: Batch, started: float, finished: float, cpu_s: float | None = None
    ) -> None:
        self.busy = False

    def stats(self, now: float) -> PolicyStats:
        return PolicyStats(
            window_s=0.0,
            cap=self.cap,
            intercept_s=0.0,
            slope_s=0.0,
            p99_batch_s=0.0,
            arrival_rps=0.0,
            queued=len(self.queue),
        )
