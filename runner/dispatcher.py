"""The live dispatcher: drives a pure batching policy with the event loop and a model thread.

The policy decides; this module only does what it says. Arrivals are offered to the policy
and refused at once when it says so; whenever the model is free, a request arrives or a
wake-up the policy asked for comes due, the policy is polled; a released batch is joined,
run on the one model thread (off the event loop) and split back to each request. Requests of
more than `max_batch_size` rows are cut into pieces that batch like any other request and are
joined again before the answer. A request's deadline passing while it is queued is answered 503,
but a piece of one the idle model was assured to finish is answered 413: too large for the
limit on this machine, as it would be at every try.

A request's size for the policy is its cost (`Signature.cost`): its rows, or for ragged or
pad inputs its elements, bounded by `max_batch_elements`; such a request is one sequence,
one row of the outputs, and never cut.

Arrivals are taken per decision, not one by one: a connection that has delivered what came
while the model runs, or while the policy waits for more rows, is held unread (`hold`) until
the batch completes or the policy's wake-up comes, when every held connection reads again
and the policy is polled once, after what they held is offered (and after a call still
coming in, for a few milliseconds at most: one too large for the socket's buffer takes
several reads). A connection is never held in the middle of a call. So a
runner wakes about once per batch for each API worker, however many requests the batch
holds; refusals meanwhile are the API workers' own, from the backlog the runner publishes
with its answers (`admission`). A connection is held no longer than the batch's
predicted time (at most `Timeouts.HOLD_MAX_S`): a batch that overruns it is read beside, so
a stall's arrivals are judged at once and a long batch does not starve its pings.

The gauges are republished after batches (at most every `Timeouts.GAUGE_PERIOD_S`) and,
once traffic stops, every `Timeouts.PUBLISH_S` until they read idle, so a scrape of an
idle runner reads idle while the idle runner sets no timer; counts are tallied in the process
and written out with the gauges and whenever the dispatcher falls idle. A rejection is counted
once per whole request, when its one answer goes out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import batching
from .core import ragged
from .core.config import RunnerConfig
from .core.signature import Signature
from .core.timeouts import Timeouts
from .core.types import BYTES, ModelInputs, Tensors
from .core.wire import FailureCode
from .metrics import RunnerMetrics
from .model_cpu import ModelCpu
from .models import Model
from .policy.base import Admission, Batch, Policy, Request
from .policy.latency_model import Timing

log = logging.getLogger(__name__)
EXIT_HUNG = 70  # the process exits with this when its model thread never came back
IDLE_RPS = 1e-4
"""An estimated arrival rate below this reads as no traffic: the gauges stop being
republished once they show it."""


@dataclass(slots=True)
class Rejection:
    """A request answered without tensors, and why; a refusal also says what it was judged on
    (see `wire.Failure`). Not frozen: overload makes one for every request it refuses."""

    code: FailureCode
    message: str
    retry_after_s: float = 0.0
    predicted_s: float = 0.0
    deadline_s: float = 0.0
    rows_ahead: int = 0


class Reader(Protocol):
    """A connection the dispatcher may hold unread while the model runs (see `hold`)."""

    def resume(self) -> None:
        """Read again: the model is free, and what came meanwhile is to be decided on."""

    @property
    def partial(self) -> bool:
        """Whether a call has begun to arrive on it and not ended."""


Reply = Callable[[Tensors | Rejection, float], None]
"""Told a request's answer, and how long before its deadline its batch ended (negative:
after; 0 for a refusal): the caller, adding how late past the deadline the answer reached
it, learns how long answers take on their way home."""
Started = Callable[[], None]
"""Told when a request's batch (or one of its pieces') goes to the model."""

_REJECTION_REASONS = {
    FailureCode.REFUSED: "queue",
    FailureCode.EXPIRED: "expired",
    FailureCode.STOPPING: "draining",
}
"""The metric reason for each failure a client gets as a 503 (model errors are 500s)."""


@dataclass(slots=True)
class _Whole:
    """A request cut into pieces: collects them and answers once."""

    reply: Reply
    pieces: list[Tensors | None]
    missing: int
    rows: int
    deadline: float
    in_time: int = 0  # the rows of its pieces answered by its deadline
    answered: bool = False


@dataclass(slots=True)
class _Job:
    tensors: Tensors
    reply: Reply
    whole: _Whole | None = None
    index: int = 0
    started: Started | None = None
    rows: int = 1  # its rows in the outputs; its size for the policy may count elements
    options: dict[str, Any] = field(default_factory=dict)  # its group_by values, decoded


@dataclass(slots=True)
class _Outcome:
    pieces: list[Tensors | str]  # each request's outputs, or why the model failed on it
    started: float
    finished: float
    cpu_s: float
    rows: int


@dataclass(slots=True)
class _Timer:
    handle: asyncio.TimerHandle | None = None
    at: float = field(default=float("inf"))


def _pin_threads(threads: int) -> None:
    """Pin torch's thread count in the model thread itself: OpenMP binds it per thread.

    Only when the model already imported torch: importing it here would cost a model that
    does not use it a second of start-up and a few hundred megabytes.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def synthetic_inputs(runner: RunnerConfig, rows: int, seed: int = 0) -> Tensors:
    """Rows shaped like the declared inputs, for timing the model before it serves.

    Floats are random, other numbers zero, BYTES rows lowercase ASCII words (valid UTF-8).
    A non-batchable input gets one empty value (zeros, or b"" for BYTES), the neutral
    choice for a parameter: the model should read it as its default. For ragged or pad
    inputs, `rows` counts elements: a batch of several requests, already joined.
    """
    if runner.layout != "rows":
        return ragged.join(runner, ragged.synthetic(runner, rows, seed))
    generator = np.random.default_rng(seed)
    dim = runner.batch_dim[0]
    tensors: Tensors = {}
    for spec in runner.inputs:
        if not spec.batchable:
            shape = [max(d, 1) for d in spec.shape]
            tensors[spec.name] = np.full(shape, b"", object) if spec.dtype == BYTES else (
                np.zeros(shape, dtype=spec.dtype))
            continue
        shape = [rows if i == dim else max(d, 1) for i, d in enumerate(spec.shape)]
        if spec.dtype.kind == "f":
            tensors[spec.name] = generator.standard_normal(shape).astype(spec.dtype)
        elif spec.dtype == BYTES:
            tensors[spec.name] = _words(generator, shape)
        else:
            tensors[spec.name] = np.zeros(shape, dtype=spec.dtype)
    return tensors


def _words(generator: np.random.Generator, shape: list[int]) -> np.ndarray:
    """BYTES elements of 4 to 32 lowercase letters."""
    words = np.empty(shape, object)
    for index in np.ndindex(*shape):
        letters = generator.integers(ord("a"), ord("z") + 1, generator.integers(4, 33))
        words[index] = letters.astype(np.uint8).tobytes()
    return words


class Dispatcher:
    """Queues requests for one model and releases batches as the policy decides."""

    def __init__(
        self,
        runner: RunnerConfig,
        model: Model,
        policy: Policy,
        metrics: RunnerMetrics,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] | None = None,
        launched: Callable[[], None] = lambda: None,
    ) -> None:
        """`launched` is told whenever a batch goes to the model (the runner publishes its
        backlog then); `cpu_clock`, read on the model thread, is the model's CPU (by default
        its thread's and its intra-op threads', `ModelCpu`)."""
        self.runner = runner
        # Outputs of one sequence a row, joined into one flat array a request when split.
        self._ragged_outputs = frozenset(
            spec.name for spec in runner.outputs if spec.layout == "ragged")
        self.launched = launched
        self.model = model
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.cpu_clock = ModelCpu() if cpu_clock is None else cpu_clock
        self.max_latency_s = runner.batching.max_latency_ms / 1000
        # The bound on a batch in the units its cost is counted in: rows, or elements for
        # ragged or pad inputs (`max_batch_elements`); a request of rows over it is cut.
        self.max_cost = runner.max_cost
        self.unit = "rows" if runner.layout == "rows" else "elements"
        self.signature = Signature(runner)
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count()
        self._busy = False
        self._accepting = True
        self._halted = False
        self._refitting = False
        self._timer = _Timer()
        self._ticker: asyncio.TimerHandle | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._model_thread = ThreadPoolExecutor(
            1, "model", initializer=_pin_threads, initargs=(runner.threads,)
        )
        self._refit_thread = ThreadPoolExecutor(1, "refit")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._held: list[Reader] = []  # connections held unread until the batch completes
        self._released: list[Reader] = []  # the ones let read when the last batch completed
        self._frame_wait: asyncio.TimerHandle | None = None  # the poll, put off for a call
        self._hold_limit: asyncio.TimerHandle | None = None
        self._hold_until = 0.0  # the running batch's predicted end: held no longer
        self._overdue = False  # the running batch overran it
        self._gathering = 0  # reads being offered: one poll after them, not one per call
        self._poll_due = False

    # --- lifetime -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Time the model at the policy's calibration sizes, so its first fit is well-posed."""
        self._loop = asyncio.get_running_loop()
        timings = []
        for i, rows in enumerate(self.policy.calibration_sizes()):
            tensors = synthetic_inputs(self.runner, rows, seed=i)
            timings.append(
                await self._loop.run_in_executor(self._model_thread, self._time, rows, tensors)
            )
        self.policy.calibrate(timings)
        self._tick()  # the fit is known before traffic

    def _tick(self) -> None:
        """Republish the gauges after traffic until they read idle (no request held, the
        arrival rate decayed to nothing): a scrape must not see a busy moment long past, and
        an idle runner sets no timer. An arrival starts the ticks again."""
        assert self._loop is not None
        self._ticker = None
        stats = self.policy.stats(self.clock())
        self.metrics.publish(stats, force=True)
        if self._jobs or stats.arrival_rps >= IDLE_RPS:
            self._ticker = self._loop.call_later(Timeouts.PUBLISH_S, self._tick)

    def _time(self, rows: int, tensors: Tensors) -> Timing:
        started, cpu = self.clock(), self.cpu_clock()
        joined = batching.join([tensors], self.runner.batch_dim[0], self.runner.unbatched)
        self.model(joined, dict(self.runner.group_timing))  # ragged inputs came joined
        return Timing(rows, self.clock() - started, self.cpu_clock() - cpu)

    @property
    def busy(self) -> bool:
        """Whether a model call is running now."""
        return self._busy

    async def drain(self, grace_s: float) -> None:
        """Let queued and running work finish within `grace_s`, then refuse what is left."""
        self._accepting = False
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            pass
        self._halt("the runner is stopping")
        self._model_thread.shutdown(wait=False, cancel_futures=True)
        self._refit_thread.shutdown(wait=False, cancel_futures=True)

    def _halt(self, why: str) -> None:
        """Refuse every request held, queued or running, and release no batch after: the
        policy's queue still names the requests just answered, and a batch still running
        would otherwise pull them out when it completes."""
        self._accepting = False
        self._halted = True
        self._release_held()
        self._arm(None, self.clock())
        for ident in list(self._jobs):
            self._answer(ident, Rejection(FailureCode.STOPPING, why, Timeouts.RETRY_AFTER_S))

    # --- arrivals -----------------------------------------------------------------------------

    def submit(
        self,
        tensors: Tensors,
        rows: int,
        budget_s: float,
        reply: Reply,
        started: Started | None = None,
        group: tuple[str, ...] = (),
        spent_s: float = 0.0,
        front_s: float = 0.0,
        arrival: float | None = None,
    ) -> None:
        """Queue one request of `rows` rows, checked against the signature already (one row
        for ragged or pad inputs); `reply` is called exactly once, on the event loop, and
        `started` whenever a batch holding it (or a piece of it) goes to the model. `group`
        holds its values of the runner's `group_by` parameters, as JSON texts; `spent_s` what
        it cost before it came (its decoding), which counts against the limit as well;
        `front_s` what its API worker spends per request lately, for the capacity gauge;
        `arrival`, when it came, on this clock, if before now (it was read late): its
        budget runs from then."""
        self.metrics.load.offer(front_s)
        try:
            options = self._group_options(group)
        except ValueError as problem:
            self._reply(reply, Rejection(FailureCode.INVALID, str(problem)))
            return
        if not self._accepting:
            self._reply(reply, Rejection(
                FailureCode.STOPPING, "the runner is stopping", Timeouts.RETRY_AFTER_S
            ))
            return
        if self._ticker is None and self._loop is not None:
            self._ticker = self._loop.call_later(Timeouts.PUBLISH_S, self._tick)
        now = self.clock()
        came = now if arrival is None or arrival > now else arrival
        deadline = came + min(budget_s, self.max_latency_s)
        cost = self.signature.cost(tensors, rows)
        if cost > self.max_cost and self.unit == "elements":
            # A sequence is never cut; the signature refuses it first, so none comes here.
            self._reply(reply, Rejection(FailureCode.INVALID, (
                f"the request has {cost} elements; runner {self.runner.name!r} takes at "
                f"most {self.max_cost} in a batch (its max_batch_elements)"
            )))
            return
        # Judged against the runner's own limit, not what is left of it: time lost on the way
        # here is a passing delay, and a request that fits an idle model may run later.
        least_s = self._least_time_s(cost)
        if spent_s + least_s > self.max_latency_s:
            self._reply(reply, self._too_large(cost, spent_s))
            return
        if cost <= self.max_cost:
            job = _Job(tensors, reply, started=started, rows=rows, options=options)
            self._offer(job, cost, now, came, deadline, group)
            return
        # On an idle model a request that fits its cost curve is taken whole, as one that
        # needs a single batch is: refused, it would be refused at every try.
        assured = not self._jobs and now + least_s <= deadline
        pieces = batching.chunk(
            tensors, rows, self.runner.batch_dim[0], self.max_cost, self.runner.unbatched
        )
        whole = _Whole(reply, [None] * len(pieces), len(pieces), rows, deadline)
        for index, (piece, size) in enumerate(pieces):
            job = _Job(piece, reply, whole, index, started, size, options)
            self._offer(job, size, now, came, deadline, group, assured)

    def _least_time_s(self, cost: int) -> float:
        """What a request of `cost` (rows, or elements) needs on an idle model: full batches
        of `max_cost`, then the rest (a sequence is never over `max_cost`: one batch)."""
        full, rest = divmod(cost, self.max_cost)
        idle_time_s = self.policy.idle_time_s
        return full * idle_time_s(self.max_cost) + (idle_time_s(rest) if rest else 0.0)

    def _too_large(self, cost: int, spent_s: float = 0.0) -> Rejection:
        """Why a request that no wait can help is refused, with the most rows (or elements)
        that fit; its decoding is taken to cost in proportion to its size."""
        low, high = 0, cost  # the most that fits lies in [low, high)
        while high - low > 1:
            middle = (low + high) // 2
            need_s = spent_s * middle / cost + self._least_time_s(middle)
            low, high = (middle, high) if need_s <= self.max_latency_s else (low, middle)
        advice = f"send at most {low} {self.unit} a request" if low else "raise max_latency_ms"
        need_ms = (spent_s + self._least_time_s(cost)) * 1000
        decoding = f" ({spent_s * 1000:.1f} ms of it to decode them)" if spent_s else ""
        return Rejection(FailureCode.TOO_LARGE, (
            f"{cost} {self.unit} need {need_ms:.1f} ms{decoding} on runner "
            f"{self.runner.name!r} even when it is idle, by its current cost model, over its "
            f"max_latency_ms of {self.runner.batching.max_latency_ms:g}; {advice}"
        ))

    def _offer(
        self, job: _Job, rows: int, now: float, arrival: float, deadline: float,
        group: tuple[str, ...], assured: bool = False,
    ) -> None:
        ident = next(self._ids)
        self._jobs[ident] = job
        if not self.policy.offer(Request(ident, rows, arrival, deadline, group, assured), now):
            self._answer(ident, self._refused(
                f"runner {self.runner.name!r} cannot answer within its deadline now",
                deadline, now,
            ))
            return
        self._idle.clear()
        if self._gathering:
            self._poll_due = True
        else:
            self._pump()

    # --- reading per decision -----------------------------------------------------------------

    def gather(self) -> None:
        """Calls read together follow: offer each, poll once after them (`gathered`)."""
        self._gathering += 1

    def gathered(self) -> None:
        self._gathering -= 1
        if not self._gathering and self._poll_due:
            self._poll_due = False
            self._pump()

    def hold(self, reader: Reader) -> bool:
        """Whether `reader` should stop reading until the next decision (then `reader.resume`
        is called): while the model runs, until the batch completes or overruns the time
        the policy predicted for it (from then on what comes is read at once, so the policy
        judges it on a batch that has stalled); while the policy waits for more rows, until
        the wake-up it asked for."""
        if self._halted or self._loop is None:
            return False
        if self._busy:
            if self._overdue:
                return False
            self._held.append(reader)
            self._limit_hold()
            return True
        if self._timer.at - self.clock() > Timeouts.HOLD_MAX_S:
            return False  # nothing is due: what comes may start a batch at once
        self._held.append(reader)
        return True

    def _limit_hold(self) -> None:
        """Read again once the running batch overruns its prediction."""
        if self._hold_limit is None and self._held and self._loop is not None:
            delay = max(0.0, self._hold_until - self.clock())
            self._hold_limit = self._loop.call_later(delay, self._overran_prediction)

    def _overran_prediction(self) -> None:
        self._hold_limit = None
        self._overdue = True
        self._release_held()

    def _release_held(self) -> None:
        """Let every held connection read again."""
        if self._hold_limit is not None:
            self._hold_limit.cancel()
            self._hold_limit = None
        held, self._held = self._held, []
        self._released = held
        for reader in held:
            reader.resume()

    def _after_reads(self, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback` once the held connections have read what came meanwhile (their
        reads land in the loop's next turn, before the turn after); at once if none is held."""
        if not self._held or self._loop is None:
            callback(*args)
            return
        self._release_held()
        self._loop.call_soon(self._loop.call_soon, callback, *args)

    def _finished(self, batch: Batch, done: Future[_Outcome]) -> None:
        """The model is back. Connections held meanwhile read first, so what came while the
        batch ran is offered as it would have been on arrival, the batch still running, and
        the next batch is chosen from all of it."""
        self._overdue = True  # what comes now is read at once
        self._after_reads(self._completed, batch, done)

    def admission(self) -> Admission:
        """What a one-row request offered now would be judged on (`Policy.admission`)."""
        return self.policy.admission(self.clock())

    # --- the loop's side: poll, launch, complete ----------------------------------------------

    def _pump_once_read(self) -> None:
        """Poll now, unless a connection let read after the batch is in the middle of a call:
        then once the call is in (offering it polls), or after `Timeouts.FRAME_WAIT_S`.

        A call larger than the socket's buffer (an image of 600 KB) takes several reads to
        come in. Polled at once, the model would start on what is whole and leave that call
        to wait for the whole of the next batch, its deadline running: at 14 images a second
        on `resnet`, calls offered 60 to 230 ms after they were sent were refused there."""
        if self._loop is not None and any(reader.partial for reader in self._released):
            self._frame_wait = self._loop.call_later(Timeouts.FRAME_WAIT_S, self._pump)
            return
        self._pump()

    def _pump(self) -> None:
        if self._frame_wait is not None:
            self._frame_wait.cancel()
            self._frame_wait = None
        if self._halted:
            return
        now = self.clock()
        step = self.policy.poll(now)
        for request in step.expired:
            self._answer(request.id, self._expired(request))
        if step.refused:
            self._refuse_oldest(step.refused, now)
        if step.batch is not None:
            self._launch(step.batch)
        self._arm(step.wake_at, now)
        if not self._busy and not self._jobs:
            # The tallies are written out once the answers are (`_account`, `_reply`).
            self._idle.set()

    def _expired(self, request: Request) -> Rejection:
        """Why a request is dropped from the queue at its deadline: 503, to come back later,
        unless it is a piece of a request the idle model was assured to finish (see
        `submit`). Then the machine ran its own pieces slower than the cost model said, and
        the request would fail the same way at every try: it is too large for the limit
        here, and the rows that did finish in time say how many fit."""
        job = self._jobs.get(request.id)
        whole = job.whole if job is not None else None
        if not request.assured or whole is None:
            return Rejection(
                FailureCode.EXPIRED,
                f"the request's deadline passed while queued for {self.runner.name!r}",
                self.max_latency_s,
            )
        in_time = whole.in_time
        advice = f"send at most {in_time} rows a request" if in_time else "raise max_latency_ms"
        return Rejection(FailureCode.TOO_LARGE, (
            f"{whole.rows} rows did not finish by the request's deadline on runner "
            f"{self.runner.name!r} even when it is idle: its pieces ran slower than its cost "
            f"model said; {advice}"
        ))

    def _refuse_oldest(self, requests: tuple[Request, ...], now: float) -> None:
        """Answer requests the policy let go from the head of its queue (`refuse: oldest`):
        503 `queue`, with when to come back."""
        for request in requests:
            self._answer(request.id, self._refused(
                f"runner {self.runner.name!r} cannot answer this request within its deadline "
                "now: it waited longest, and newer ones can still be served",
                request.deadline, now,
            ))

    def _refused(self, message: str, deadline: float, now: float) -> Rejection:
        """A 503 `queue` carrying what the policy judged on (`Policy.refusal`), and when to
        come back: once the backlog could drain, else the limit (at least the floor)."""
        retry = max(self.max_latency_s, Timeouts.RETRY_FLOOR_S)
        why = self.policy.refusal()
        predicted_s, ahead = (why.predicted_finish - now, why.rows_ahead) if why else (0.0, 0)
        if why is not None and why.retry_after_s > 0.0:
            retry = why.retry_after_s
        return Rejection(FailureCode.REFUSED, message, retry, predicted_s, deadline - now, ahead)

    def _arm(self, wake_at: float | None, now: float) -> None:
        timer = self._timer
        at = float("inf") if wake_at is None else wake_at
        if at == timer.at:
            return
        if timer.handle is not None:
            timer.handle.cancel()
            timer.handle = None
        timer.at = at
        if wake_at is not None and self._loop is not None:
            # Never sleep past the latency limit, whatever the policy asked: a clock that
            # jumped or a wrong wake-up time costs one extra poll, never a stranded queue.
            delay = min(max(0.0, at - now), self.max_latency_s)
            timer.handle = self._loop.call_later(delay, self._wake)

    def _wake(self) -> None:
        """The wake-up the policy asked for: connections held until it read first."""
        self._timer.handle = None
        self._timer.at = float("inf")
        self._after_reads(self._pump)

    def _launch(self, batch: Batch) -> None:
        assert self._loop is not None, "start() runs before any request"
        self._busy = True
        predicted_s = batch.predicted_s or Timeouts.HOLD_MAX_S
        self._hold_until = self.clock() + min(predicted_s, Timeouts.HOLD_MAX_S)
        self._overdue = False
        self._limit_hold()  # connections held while the policy waited stay held
        self.launched()
        jobs = [self._jobs[request.id] for request in batch.requests]
        for job in jobs:
            if job.started is not None:
                job.started()
        parts = [job.tensors for job in jobs]
        sizes = [job.rows for job in jobs]
        future = self._model_thread.submit(self._execute, parts, sizes, jobs[0].options)
        future.add_done_callback(lambda done: self._to_loop(self._finished, batch, done))
        self._watchdog = self._loop.call_later(
            self.runner.batch_timeout_s, self._overran, batch
        )

    def _overran(self, batch: Batch) -> None:
        """The model call ran past the runner's time limit: its requests fail now (504). The
        thread cannot be stopped from outside; if it is not back within another limit, the
        process refuses what it holds and exits, and its supervisor starts a fresh one."""
        assert self._loop is not None
        limit = self.runner.batch_timeout_s
        log.error("runner %s: a batch of %d rows is still running after %g s",
                  self.runner.name, batch.rows, limit)
        failure = Rejection(FailureCode.TIMEOUT,
                            f"the model did not finish the request's batch within {limit:g} s")
        for request in batch.requests:
            self._answer(request.id, failure)
        self._watchdog = self._loop.call_later(limit, self._give_up)

    def _give_up(self) -> None:
        assert self._loop is not None
        log.critical("runner %s: the model thread has not come back; exiting to be replaced",
                     self.runner.name)
        self._halt("the runner is restarting")
        self._loop.call_later(Timeouts.EXIT_DELAY_S, os._exit, EXIT_HUNG)

    def _to_loop(self, callback: Callable[..., None], *args: Any) -> None:
        """From a worker thread: run `callback` on the loop, unless the runner has stopped."""
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed after a drain
            self._loop.call_soon_threadsafe(callback, *args)

    def _group_options(self, group: tuple[str, ...]) -> dict[str, Any]:
        """A call's `group_by` values as the model takes them, keywords, decoded once on
        arrival; ValueError says what is wrong (the API writes one JSON value for each
        parameter; another peer may not)."""
        names = self.runner.group_by
        if len(group) != len(names):
            raise ValueError(f"runner {self.runner.name!r} batches by {len(names)} parameters; "
                             f"the call carried {len(group)} values")
        options = {}
        for name, text in zip(names, group, strict=True):
            try:
                options[name] = json.loads(text)
            except ValueError:
                raise ValueError(f"the call's value of parameter {name!r} is not JSON") from None
        return options

    def _execute(
        self, parts: list[Tensors], sizes: list[int], options: dict[str, Any]
    ) -> _Outcome:
        """On the model thread: join, run, split; errors become an outcome, never a crash."""
        started, cpu = self.clock(), self.cpu_clock()
        pieces = self._run(parts, sizes, options)
        return _Outcome(pieces, started, self.clock(), self.cpu_clock() - cpu, sum(sizes))

    def _run(
        self, parts: list[Tensors], sizes: list[int], options: dict[str, Any]
    ) -> list[Tensors | str]:
        """Each request's outputs; a batch the model fails on is split in halves until the
        requests that make it fail stand alone, so only they fail (a poison request)."""
        try:
            outputs = self.model(self._join(parts), options)
            return list(batching.split(outputs, sizes, self.runner.batch_dim[1],
                                       self._ragged_outputs))
        except Exception as exc:
            if len(parts) > 1:
                half = len(parts) // 2
                return (self._run(parts[:half], sizes[:half], options)
                        + self._run(parts[half:], sizes[half:], options))
            log.exception("runner %s: a request of %d rows failed", self.runner.name, sizes[0])
            return [f"{type(exc).__name__}: {exc}"]

    def _join(self, parts: list[Tensors]) -> ModelInputs:
        """The model's inputs: rows stacked (unbatched inputs one item a request), or ragged
        and pad inputs with their batch inputs."""
        if self.runner.layout == "rows":
            return batching.join(parts, self.runner.batch_dim[0], self.runner.unbatched)
        return dict(ragged.join(self.runner, parts))

    def _completed(self, batch: Batch, done: Future[_Outcome]) -> None:
        """Answer the batch's requests, then poll again, whatever answering raised; the
        batch is counted after the answers are written (`_account`), not before."""
        self._busy = False
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        try:
            if done.cancelled():
                return
            outcome = done.result()
            self.policy.complete(batch, outcome.started, outcome.finished, outcome.cpu_s)
            for request, piece in zip(batch.requests, outcome.pieces, strict=True):
                if isinstance(piece, str):
                    self._answer(request.id, Rejection(
                        FailureCode.MODEL_ERROR, f"the model failed: {piece}"))
                else:
                    self._answer(request.id, piece, request.deadline - outcome.finished)
        finally:
            self._pump_once_read()
        # Only a batch with an outcome comes here (a cancelled one returned, a failed one
        # raised). Its answers' writes were queued for this turn's end; this goes after them.
        assert self._loop is not None, "start() runs before any batch"
        self._loop.call_soon(self._account, batch, outcome)

    def _account(self, batch: Batch, outcome: _Outcome) -> None:
        """Count a batch whose answers are out, republish the gauges, maybe refit."""
        self.metrics.batch(batch, outcome.started, outcome.finished, outcome.cpu_s, outcome.rows)
        self.metrics.publish(self.policy.stats(self.clock()))
        if not self._busy and not self._jobs:
            self.metrics.flush()  # a scrape after the last answer counts all of it
        self._maybe_refit()

    def _answer(self, ident: int, result: Tensors | Rejection, spare_s: float = 0.0) -> None:
        job = self._jobs.pop(ident, None)
        if job is None:
            return
        try:
            if job.whole is None:
                self._reply(job.reply, result, spare_s)
            else:
                self._answer_piece(job, result, spare_s)
        except Exception:  # one answer that cannot be sent must not strand the others
            log.exception("runner %s: answering request %d failed", self.runner.name, ident)

    def _answer_piece(self, job: _Job, result: Tensors | Rejection, spare_s: float) -> None:
        whole = job.whole
        assert whole is not None
        if whole.answered:
            return
        if isinstance(result, Rejection):
            whole.answered = True
            self._reply(whole.reply, result)
            return
        whole.pieces[job.index] = result
        whole.missing -= 1
        if self.clock() <= whole.deadline:
            whole.in_time += job.rows
        if whole.missing == 0:
            whole.answered = True
            pieces = [piece for piece in whole.pieces if piece is not None]
            whole.reply(batching.concatenate(pieces, self.runner.batch_dim[1]), spare_s)

    def _reply(self, reply: Reply, result: Tensors | Rejection, spare_s: float = 0.0) -> None:
        """Send a whole request's one answer, counting it if it is a 503."""
        if isinstance(result, Rejection):
            reason = _REJECTION_REASONS.get(result.code)
            if reason is not None:
                self.metrics.rejected(reason)
                if not self._jobs and not self._busy:
                    self.metrics.flush()
        reply(result, spare_s)

    # --- refits, off the critical path --------------------------------------------------------

    def _maybe_refit(self) -> None:
        if self._refitting or self._halted or self._loop is None:
            return
        job = self.policy.refit_job(self.clock())
        if job is None:
            return
        self._refitting = True
        future = self._refit_thread.submit(job)
        future.add_done_callback(lambda done: self._to_loop(self._refitted, done))

    def _refitted(self, done: Future[Any]) -> None:
        self._refitting = False
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            log.error("runner %s: latency model refit failed: %s", self.runner.name, error)
            return
        self.policy.apply_fit(done.result())
