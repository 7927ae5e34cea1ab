"""The adaptive batching policy: the product the baselines are measured against.

Deadline-aware admission, a bounded hold under load and a closed-form cap, all driven by the latency
model in `batchserve.runner.policy.latency_model` (docs/dispatcher.md). It honours the contract
in `batchserve.runner.policy.base` and is built by name through
`batchserve.runner.policy.policies.make_policy("adaptive", ...)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

from ..core.config import REFUSE_MODES, Refuse
from ..core.retry import retry_after_s
from .base import NO_ADMISSION, Admission, Batch, PolicyStats, Reason, Refusal, Request, Step
from .latency_model import Fit, LatencyModel, RecentQuantile, Timing, fit_samples
from .state import Costs, Limits, Rates, Refits, Running, Waiting
from .tuning import DEFAULT_TUNING, Tuning

TAIL_INDEX = 3.0
"""How the heavy tail of batch times (the part of the high quantile beyond `k * spread`) adds
up over several batches: as the `TAIL_INDEX`-norm of their means. For a power-law tail of this
index, the chance that a sum of batches runs a given excess over is the sum of the chances of
each batch alone (one batch rarely hits at once with another), which gives that norm; the
normal part still adds in quadrature (docs/dispatcher.md, "The tail")."""


class AdaptivePolicy:
    """Deadline-aware adaptive batching driven by a latency model (docs/dispatcher.md).

    - admits a request only if its predicted high-quantile completion meets its deadline;
    - releases at once unless fewer rows are queued than arrive during one batch intercept
      (`target_rows`), in which case it waits at most `window_s`, and never so long that the
      earliest deadline in the queue is put at risk;
    - caps a batch at the size that maximises the rate of answers within the deadline.

    With `refuse="oldest"` it admits every request instead, and refuses the oldest queued
    requests once their batch, as the queue would make it, is predicted to end past their
    deadline at the high quantile: when the model frees, or earlier, while a batch runs, when
    even the next batch could not end in time (docs/dispatcher.md, "Refusal modes").
    """

    def __init__(
        self,
        max_batch_size: int,
        max_latency_s: float,
        tuning: Tuning = DEFAULT_TUNING,
        *,
        max_requests: int | None = None,
        refuse: Refuse = "at_arrival",
    ) -> None:
        """`max_batch_size` caps a batch in the units requests are sized in (`Request.rows`:
        rows, or elements for ragged inputs); `max_requests`, if given, also caps how many
        requests one batch holds (a runner's `max_batch_size` when it counts elements)."""
        if refuse not in REFUSE_MODES:
            raise ValueError(f"refuse has value {refuse!r}; it must be one of "
                             + ", ".join(REFUSE_MODES))
        self.limits = Limits(max_batch_size, max_latency_s, max_requests)
        self.oldest = refuse == "oldest"
        self.tuning = tuning
        self.model = LatencyModel(tuning)
        # The decisions, as the last retune left them (see `stats`).
        self.cap = max_batch_size
        self.window_s = 0.0
        self.target_rows = 0.0
        self.refused = 0
        self._waiting = Waiting()
        self._busy = Running()
        self._rates = Rates.with_memory(tuning.rate_tau_s, tuning.refused_memory_s)
        self._refits = Refits()
        # How long the model stands idle before a batch: between two run back to back the
        # loop has to see one end and the model thread to pick up the next; after a release
        # from idle, the model thread has to wake. No batch's own time shows it, yet a request
        # waits one per batch ahead; on cores shared with busy API workers it is
        # milliseconds. Every batch measures it, so it heals with the machine even while
        # refusals leave no batch run back to back (a 70 ms p99 from a busy spell once stood
        # for seconds and refused most requests).
        self._gaps = RecentQuantile(
            window=tuning.gap_window, every=tuning.gap_every, quantile=tuning.gap_quantile
        )
        self._refusal: Refusal | None = None
        # Spreads of normal noise a promise keeps (`_reserve`), and the late answers it may
        # still spend (`_learn_lateness`).
        self.promise_k = tuning.promise_k
        self._late_allowance = 0.0
        # What the last promise into the next batch bounds, valid while nothing it was worked
        # out from changes (`_epoch`: a batch taken or completed, a new cap or fit).
        self._epoch = 0
        self._bound: _Bound | None = None
        self._use(Fit())

    # --- the contract ---------------------------------------------------------------------

    def offer(self, request: Request, now: float) -> bool:
        self._rates.requests.add(now)
        self._rates.rows.add(now, request.rows)
        if self.oldest:
            if self._busy.batch is None and not self._waiting.requests \
                    and now + self.model.idle_cost(request.rows) <= request.deadline:
                self._waiting.probe = request.id  # as `_admits` would take it
        elif not self._admits(request, now):
            self.refused += 1
            return False
        self._waiting.add(request, self.cap)
        self._rates.admitted.add(now, request.rows)
        self._rates.admitted_now.add(now, request.rows)
        return True

    def poll(self, now: float) -> Step:
        expired = self._expire_head(now)
        queue, busy = self._waiting.requests, self._busy
        refused, shed_at = self._shed_oldest(now) if self.oldest else ((), None)
        if busy.batch is not None:
            wake_at = queue[0].deadline if queue else None
            if shed_at is not None and wake_at is not None:
                wake_at = min(wake_at, shed_at)
            return Step(expired=expired, wake_at=wake_at, refused=refused)
        chained, busy.just_completed = busy.just_completed, False
        if not queue:
            return Step(expired=expired, refused=refused)
        self._retune(now)
        reason, wake_at = self._decide(now)
        if reason is None:
            return Step(expired=expired, wake_at=wake_at, refused=refused)
        batch, dropped = self._take(now, reason)
        busy.chained = chained and batch is not None
        return Step(batch=batch, expired=expired + dropped, refused=refused)

    def complete(
        self, batch: Batch, started: float, finished: float, cpu_s: float | None = None
    ) -> None:
        busy, refits = self._busy, self._refits
        self._epoch += 1
        busy.batch = None
        after = busy.last_finished if busy.chained else busy.released
        self._gaps.add(max(0.0, started - after))
        busy.last_finished, busy.just_completed = finished, True
        self._learn_lateness(batch, finished)
        elapsed = finished - started
        rows = batch.rows
        if self.model.add(rows, elapsed, elapsed if cpu_s is None else cpu_s):
            refits.shifted = True
        refits.fresh += 1
        refits.fresh_rows += rows

    def _learn_lateness(self, batch: Batch, finished: float) -> None:
        """Move the promise's reserve with the lateness its answers show.

        Every answer earns an allowance of `late_share` late answers, every late one spends
        one, and the allowance decays over `late_window` answers. A late answer puts the
        reserve back at `promise_k` at once; while none is late and the allowance would cover
        this whole batch late, it falls toward `promise_floor` (`Tuning.reserve_fall`). So the
        reserve only takes risks the late target can pay for: on a tight limit with small
        batches it falls within a few thousand answers, while with large batches, of which
        one late is more than the target allows, it stays where it was.
        """
        tuning = self.tuning
        answers = len(batch.requests)
        late = sum(1 for request in batch.requests if finished > request.deadline)
        decay = max(0.0, 1.0 - answers / tuning.late_window)
        self._late_allowance = (self._late_allowance * decay
                                + tuning.late_share * answers - late)
        if late:
            self.promise_k = tuning.promise_k
        elif self._late_allowance >= answers:
            self.promise_k = max(tuning.promise_floor,
                                 self.promise_k - tuning.reserve_fall * answers)

    def stats(self, now: float) -> PolicyStats:
        fit = self._costs.fit
        return PolicyStats(
            window_s=self.window_s,
            cap=self.cap,
            intercept_s=fit.intercept_s,
            slope_s=fit.slope_s,
            p99_batch_s=fit.high(self.cap),
            arrival_rps=self._rates.requests.rate(now),
            queued=len(self._waiting.requests),
            queue_wait_s=self._rates.queue_wait_s,
            target_rows=self.target_rows,
            spread=fit.spread,
            stretch=fit.stretch,
            gap_s=self._gaps.mean,
            fit=fit,
        )

    def calibration_sizes(self) -> tuple[int, ...]:
        sizes = sorted({min(2**i, self.limits.max_batch_size) for i in range(32)})
        return tuple(sizes) * self.tuning.calibration_repeats

    def calibrate(self, timings: Sequence[Timing]) -> None:
        # Before the runner is ready nothing is latency-critical, so fit inline: the first
        # request then meets a well-posed model even if no refit has run yet.
        self.model.calibrate(timings)
        self.apply_fit(fit_samples(self.model.snapshot()))

    def refit_job(self, now: float) -> Callable[[], Any] | None:
        refits, tuning = self._refits, self.tuning
        pending = refits.pending_since
        if pending is not None and now - pending < tuning.stale_job_s:
            return None
        # A refit costs milliseconds of CPU: at small batches, every 16 batches would be many
        # a second. Wait for enough new batches, rows and time, so that refits stay a small
        # share of the work served, unless the cost shifted (a run of slow batches).
        due = (
            refits.fresh >= tuning.refit_every
            and refits.fresh_rows >= tuning.refit_rows
            and now - refits.last >= tuning.refit_period_s
        )
        if not due and not (refits.shifted and refits.fresh > 0):
            return None
        refits.last = now
        refits.fresh = refits.fresh_rows = 0
        refits.shifted = False
        refits.pending_since = now
        return partial(fit_samples, self.model.snapshot())

    def apply_fit(self, fit: Any) -> None:
        self._refits.pending_since = None
        self._use(fit)

    def idle_time_s(self, rows: int) -> float:
        return self.model.idle_cost(rows)

    # --- predictions ----------------------------------------------------------------------

    def _admits(self, request: Request, now: float) -> bool:
        """Whether the request is promised to finish by its deadline.

        An idle model with nothing queued takes any request whose rows alone fit the deadline
        on the cost curve: serving it costs no one anything, and its batch tells the model
        how the machine runs now, so a stretch learned in a bad moment cannot refuse every
        request for ever. The same holds for a request cut into pieces: the dispatcher marks
        its pieces `assured` when the whole fits the idle model on the cost curve, else a
        request of a few pieces, refused on the reserve of its later ones, would be refused
        at every try on an idle model.
        """
        busy, waiting = self._busy, self._waiting
        if busy.batch is None and not waiting.requests:
            waiting.probe = request.id
            finish = now + self.model.idle_cost(request.rows)
            if finish <= request.deadline:
                return True
            return self._refuse(request, finish, 0, now)
        if request.assured:  # the rest of a request cut into pieces that the rule above took
            return True
        if self._within_bound(request, now):
            return True
        deadline = request.deadline
        plan = self._plan(request.rows, now, request.group)
        finish = self._promise(plan, now, deadline)
        if finish <= deadline:
            if self._keeps_members(request, plan, now):
                self._bound_next(request, plan, now)
                return True
            if self._close_next(request, now):
                return True
        if self._stretch_next(request, now):
            return True
        running = busy.batch.rows if busy.batch is not None else 0
        return self._refuse(request, finish, waiting.rows + running, now)

    def _close_next(self, request: Request, now: float) -> bool:
        """Close the batch `request` would join at the rows it holds and admit `request` to
        the batch after, if it is in time there: joining, it would end that batch past a
        member's deadline.

        The members' deadlines come first, and nothing more may join a batch that cannot
        take one more row; but the request need not be refused for that. A batch held for
        its window and polled late (on cores a neighbour shares, the loop's timer fires
        milliseconds late) had refused every arrival after its window until it went: 3-36%
        of 64 closed-loop clients beside a process spinning on one core. Only the open
        batch behind those closed closes: a request for a later one has no member there.
        Only on an idle model: behind a running batch the next batch goes as soon as the
        model frees, and closing there moved which load step of a shifting grid cell ran
        late (0.124% late, not 0.084%) without helping the closed loop measurably.
        """
        waiting = self._waiting
        if self._busy.batch is not None:
            return False  # in time behind a batch on the model, it would have been admitted
        if not waiting.only(request.group):
            return False  # another group's batch is next
        room = max(self.cap, waiting.next_rows) if not waiting.closed else self.cap
        if waiting.rows - waiting.closed_rows + request.rows > room:
            return False  # the request's batch is a later one
        if not waiting.close():
            return False  # no member to keep: nothing to close
        plan = self._plan(request.rows, now, request.group)
        if self._promise(plan, now, request.deadline) > request.deadline:
            waiting.reopen()
            return False
        self._epoch += 1
        self._bound = None
        return True

    def _bound_next(self, request: Request, plan: _Plan, now: float) -> None:
        """Keep what a request joining the next batch is promised at most: that batch's end
        holding all the rows it has room for, with the whole reserve (what `_promise` and
        `_keeps_members` work out, for any rows up to the room and any deadline). Only for a
        request of the only group queued whose rows fit that batch, on a model not stalled."""
        waiting = self._waiting
        if (not waiting.only(request.group) or waiting.rows + request.rows > plan.room
                or self._stalled(now)):
            self._bound = None
            return
        finish = self._own_finish(plan, plan.room, math.inf)
        self._bound = _Bound(self._epoch, request.group, plan.room, finish, self._start_at(now))

    def _within_bound(self, request: Request, now: float) -> bool:
        """Whether `_bound_next`'s bound, moved on with the next batch's start, admits
        `request` and keeps every queued request's promise: then the full test would admit
        it too, and a batch's worth of arrivals pays for that test once, not each."""
        bound, waiting = self._bound, self._waiting
        if bound is None or bound.epoch != self._epoch or bound.group != request.group:
            return False
        if not waiting.ordered or not waiting.only(request.group) or self._stalled(now):
            return False
        if waiting.rows + request.rows > bound.room:
            return False
        finish = bound.finish + self._start_at(now) - bound.start
        earliest = waiting.requests[0].deadline if waiting.requests else math.inf
        return finish <= request.deadline and finish <= earliest

    def _stalled(self, now: float) -> bool:
        busy = self._busy
        return busy.batch is not None and now >= busy.stalled_at

    def _start_at(self, now: float) -> float:
        """When the next batch starts on a model not stalled (`_next_start`, which the bound
        on the next batch moves with).

        On an idle model the batch queued goes when the window its head opened ends (sooner
        if it fills, at once if closed): a request joining it starts with it, not a whole
        window after it came.
        """
        busy, waiting = self._busy, self._waiting
        if busy.batch is None:
            if waiting.closed:
                return now
            if waiting.requests:
                return max(now, waiting.requests[0].arrival + self.window_s)
            return now + self.window_s
        return busy.done_mean if busy.done_mean > now else now

    def _refuse(self, request: Request, finish: float, ahead: int, now: float) -> bool:
        """Refuse `request` at arrival."""
        self._refused((request,), finish, ahead, now)
        return False

    def _refused(
        self, requests: Sequence[Request], finish: float, ahead: int, now: float
    ) -> None:
        """Count the refused rows in the backlog that sets when their clients should come
        back, and keep what they were judged on."""
        refused = self._rates.refused
        for request in requests:
            refused.add(now, request.rows)
        backlog = refused.rate(now) * refused.tau_s
        self._refusal = Refusal(finish, ahead, retry_after_s(self.drain_s(ahead + backlog)))

    def refusal(self) -> Refusal | None:
        return self._refusal

    def admission(self, now: float) -> Admission:
        """What `_admits` would promise a one-row request now: nothing when the model stands
        idle (it takes any request that fits alone) and with `refuse: oldest`, which refuses
        nothing on arrival."""
        waiting, busy = self._waiting, self._busy
        if self.oldest or (busy.batch is None and not waiting.requests):
            return NO_ADMISSION
        finish = self.promised_finish(1, now)
        if (waiting.rows < self.limits.max_batch_size and len(waiting.group_rows) <= 1
                and not waiting.closed):
            # The next batch may stretch past the cap to take it (`_stretch_next`).
            finish = min(finish, self._stretched_finish(waiting.rows + 1, now, math.inf))
        ahead = waiting.rows + (busy.batch.rows if busy.batch is not None else 0)
        rates = self._rates
        backlog = rates.refused.rate(now) * rates.refused.tau_s
        requests = rates.requests.rate(now)
        request_rows = rates.rows.rate(now) / requests if requests > 0.0 else 1.0
        return Admission(finish - now, ahead, self.drain_s(ahead + backlog), self.drain_s(1),
                         request_rows, max(self.cap, waiting.next_rows))

    def drain_s(self, rows: float) -> float:
        """How long the model takes to serve `rows` at full speed: batches at the cap, back to
        back, as the fit predicts them now. Of the rows ahead plus the refused backlog, this
        is when a refused client's retry could be served: sooner, it would find the same
        queue, and the backlog's other clients back in it (docs/dispatcher.md, "Refusals")."""
        cap = self.cap
        return rows * self._costs.fit.mean(cap) / cap

    def promised_finish(
        self, rows: int, now: float, group: tuple[str, ...] = (), deadline: float = math.inf
    ) -> float:
        """Predicted (high-quantile) completion of `rows` of `group` joining the back of the
        queue now.

        O(1) in the queue's length: the queue ahead is served in batches of the current cap
        (the next one may have been promised more rows, see `_stretch_next`), and the
        request's own batch also takes the rows that will arrive before it starts (FIFO: they
        join it). Other groups' queued rows all count as ahead, in batches of their own.
        """
        return self._promise(self._plan(rows, now, group), now, deadline)

    def _promise(self, plan: _Plan, now: float, deadline: float) -> float:
        """`promised_finish` on a plan: its own batch with the rows expected to join it."""
        rates = self._rates
        rate = max(rates.admitted.rate(now), rates.admitted_now.rate(now))
        if now >= self._busy.stalled_at:
            # A stall refuses what arrives early in it, so the admitted rate falls to nothing;
            # what arrives once its end is in sight joins the batch after it.
            rate = max(rate, rates.rows.rate(now))
        joining = rate * (plan.own_start - now)
        return self._own_finish(plan, min(plan.room, plan.rest + joining), deadline - now)

    def _keeps_members(self, request: Request, plan: _Plan, now: float) -> bool:
        """Whether the batch `request` joins, as it stands with its rows, still ends by the
        earliest deadline of the requests queued in it.

        Each member was promised its batch with the rows expected to join it at the admitted
        rate, but a joiner is judged on its own deadline, which comes later: on its own test,
        a batch would grow until it ended by its newest member's deadline, past its oldest's.
        No reserve for noise shows that, only one for the rate the joiners come at. So a
        joiner is admitted only if its batch keeps every member's promise too: with batch
        times that never vary, `tight_slo` was otherwise late 1.1% and `cost_doubling` 1.3%,
        where they are late 0.1% and 0.16% with noise (docs/dispatcher.md, decision 1).
        """
        members = plan.rest - request.rows
        if members <= 0:
            return True
        earliest = self._waiting.earliest(request.group, members)
        return self._own_finish(plan, plan.rest, earliest - now) <= earliest

    def _plan(self, rows: int, now: float, group: tuple[str, ...]) -> _Plan:
        """The batches the queue makes before `rows` of `group` joining it now, and the rows
        already queued for their own batch (see `promised_finish`)."""
        intercept_s, slope_s = self._costs.mean_intercept_s, self._costs.mean_slope_s
        start, running_s = self._next_start(now)
        sums = _Sums(running_s, self._busy.rows)
        cap, waiting = self.cap, self._waiting
        own = waiting.group_rows.get(group, 0)
        alone = waiting.only(group)
        first = max(cap, waiting.next_rows) if alone else cap
        ahead, batches = 0.0, 0
        if waiting.closed and alone:
            for size in waiting.closed:  # a few at most: closed batches go when the model frees
                closed_s = intercept_s + slope_s * size
                sums.add(closed_s, 1, size)
                ahead, batches = ahead + closed_s, batches + 1
            own, first = max(0, own - waiting.closed_rows), cap
        total = own + rows
        if total <= first:
            rest, room, batches = total, first, batches + 1
        else:
            first_s = intercept_s + slope_s * first
            full, rest = divmod(total - first, cap)
            if rest == 0:
                full, rest = full - 1, cap
            batch_s = intercept_s + slope_s * cap
            ahead += first_s + full * batch_s
            sums.add(first_s, 1, first)
            sums.add(batch_s, full, cap)
            room, batches = cap, batches + 2 + full
        if not alone:
            others_s, others = self._other_groups(group, sums)
            ahead, batches = ahead + others_s, batches + others
        # One gap before every batch still to start; the worst of them at its high quantile
        # is part of the reserve's tail.
        ahead += batches * self._gaps.mean
        return _Plan(start + ahead, sums, rest, room)

    def _own_finish(self, plan: _Plan, rows: float, budget_s: float) -> float:
        """When the plan's own batch ends holding `rows` (high quantile)."""
        own_s = self._costs.mean_intercept_s + self._costs.mean_slope_s * rows
        sums = plan.sums.plus(own_s, rows)
        return plan.own_start + own_s + self._reserve(sums, budget_s)

    def _other_groups(self, group: tuple[str, ...], sums: _Sums) -> tuple[float, int]:
        """The mean time and count of the batches other groups' queued rows make (each
        group's in batches of the cap), added to `sums`."""
        costs, cap = self._costs, self.cap
        intercept_s, slope_s = costs.mean_intercept_s, costs.mean_slope_s
        seconds, count = 0.0, 0
        for key, key_rows in self._waiting.group_rows.items():
            if key == group or key_rows <= 0:
                continue
            batches = -(-key_rows // cap)
            batch_s = intercept_s + slope_s * key_rows / batches
            sums.add(batch_s, batches, key_rows / batches)
            seconds += batches * batch_s
            count += batches
        return seconds, count

    def _reserve(self, sums: _Sums, budget_s: float = math.inf) -> float:
        """The high-quantile reserve over batches with these means, and over the wait for the
        model before one of them running to its high quantile.

        Noise within the normal spread is independent from batch to batch and adds in
        quadrature. An error in the fitted line is not: it is the same in every batch, so it
        adds up whole over them (`Fit.line_error`), then joins that noise in quadrature,
        being independent of it. The heavy tail beyond it (contention, measured as the
        stretches' own 99th percentile) adds as a `TAIL_INDEX`-norm: nearer the largest
        batch's than quadrature's.
        A long wait for the model is the same contention seen between batches, and joins
        that norm: adding it whole to the batches' tail counted two rare delays as one that
        always comes, and on cores a busy neighbour took (a 50 ms wait and 20-fold batches at
        p99) promised past the limit and refused most requests.

        The normal part is taken at `promise_k` spreads rather than the model's `k` (which
        keeps `Fit.high` the honest p99 of one batch, and the shift band): the
        late target is 0.1% of requests, and in overload nearly every admitted request sits
        at the edge of its promise, so a promise must hold 99.9% of the time (3.09 sigma),
        with a little more for a spread estimated from a few hundred batches and for the
        right skew of multiplicative noise.
        """
        k, margin = self.model.quantile_k, self._costs.margin
        normal = min(margin, k * self._costs.fit.spread)
        tail = margin - normal
        line_s = self._costs.fit.line_error(sums.batches, sums.rows)
        normal_part = self.promise_k / k * math.sqrt(
            normal * normal * sums.squares + k * k * line_s * line_s)
        tail_part = tail * sums.tail_norm()
        gap_s = self._gaps.high - self._gaps.mean
        if gap_s > 0.0:
            tail_part = (tail_part**TAIL_INDEX + gap_s**TAIL_INDEX) ** (1.0 / TAIL_INDEX)
        return normal_part + min(tail_part, self.tuning.tail_share * budget_s)

    def _next_start(self, now: float) -> tuple[float, float]:
        """When the next batch is expected to start, and the mean time of the running batch
        whose end that is (0 when the model is idle).

        A running batch past its mean is expected to end now, unless it has stalled: then
        it is expected to run as long as the stalls seen lately, or on for half as long as it
        has run (`Tuning.stall_after`), so requests that a stall would strand in the queue are
        refused at once, not answered late or at their deadline.
        """
        busy = self._busy
        if busy.batch is None:
            return self._start_at(now), 0.0
        if self._stalled(now):
            mean_s = busy.mean_s
            overrun = now - busy.done_mean
            longer = [seconds for seconds in self._costs.fit.overruns if seconds > overrun]
            if longer:
                return busy.done_mean + sum(longer) / len(longer), mean_s
            began = busy.done_mean - mean_s
            return now + (now - began) / (TAIL_INDEX - 1.0), mean_s
        return self._start_at(now), busy.mean_s

    def _stretch_next(self, request: Request, now: float) -> bool:
        """Admit `request` into the next batch past the cap, if everyone in it stays on time.

        The cap is the best size for a stream of batches, but one request that it would push
        to the batch after, too late, may still ride in the next batch when that batch has
        room and time to spare. The batch is then promised exactly these rows: later
        arrivals queue behind it.
        """
        waiting = self._waiting
        rows = waiting.rows + request.rows
        if rows <= max(self.cap, waiting.next_rows) or rows > self.limits.max_batch_size:
            return False
        if waiting.closed:
            return False
        if not waiting.only(request.group):
            return False  # the next batch is another group's, or this one's is not next
        if len(waiting.requests) + 1 > self.limits.request_bound:
            return False
        finish = self._stretched_finish(rows, now, request.deadline - now)
        earliest = min((queued.deadline for queued in waiting.requests), default=math.inf)
        if finish > min(earliest, request.deadline):
            return False
        waiting.next_rows = rows
        self._epoch += 1
        return True

    def _stretched_finish(self, rows: int, now: float, budget_s: float) -> float:
        """When the next batch would end holding `rows` (high quantile)."""
        start, running_s = self._next_start(now)
        batch_s = self._costs.mean_intercept_s + self._costs.mean_slope_s * rows
        sums = _Sums(running_s, self._busy.rows)
        sums.add(batch_s, 1, rows)
        return start + self._gaps.mean + batch_s + self._reserve(sums, budget_s)

    def _use(self, fit: Fit) -> None:
        self._epoch += 1
        self.model.fit = fit
        self._costs = Costs.of(fit)

    def _retune(self, now: float) -> None:
        """Cap, target and window from the fit and the arrival rate (closed forms, O(1))."""
        rows_rate = self._rates.rows.rate(now)
        request_rate = self._rates.requests.rate(now)
        costs, limits = self._costs, self.limits
        cap = self.cap
        self.cap = best_cap(
            costs.high_intercept_s, costs.high_slope_s, rows_rate, limits.max_latency_s,
            limits.max_batch_size,
        )
        if self.limits.max_requests is not None and request_rate > 0:
            # Batches end at max_requests when requests are small: what a full one holds
            # then, at the mean size lately, is the cap promises must count with.
            full = self.limits.max_requests * rows_rate / request_rate
            self.cap = max(1, min(self.cap, int(full)))
        intercept = self._costs.fit.intercept_s
        self.target_rows = rows_rate * intercept
        self.window_s = max(0.0, intercept - 1.0 / request_rate) if request_rate > 0 else 0.0
        hold = self.hold_s(intercept, self._costs.fit.slope_s, rows_rate, self.cap)
        if request_rate * hold >= self.tuning.hold_min_arrivals and hold > self.window_s:
            self.window_s = hold
            self.target_rows = max(self.target_rows, rows_rate * hold)
        if self.cap != cap:
            self._epoch += 1  # the next batch's room (a new window only moves its start)

    def hold_s(self, intercept_s: float, slope_s: float, rows_per_s: float, cap: int) -> float:
        """How long, under load, a batch may wait to amortise its fixed cost.

        Each batch costs the machine more than its rows: its intercept (on a shared machine,
        a model thread that wakes to cold caches), and the wake-ups of the event loop and the
        API workers it answers, on cores they share. A hold gathers the rows at which the
        intercept is half the batch (`intercept / slope`; fewer if the cap, or the rows that
        arrive in the longest hold, are fewer), for at most `hold_share` of the latency
        limit, where that pays: while serving one request at a time would keep the model
        busy at least `hold_load` of the time (below, the model is mostly idle and nothing
        waits), and batches of that size would keep it busy less than that (above, near
        capacity, the queue fills batches by itself and a hold only spends deadlines).
        See docs/dispatcher.md, "Release".
        """
        tuning = self.tuning
        if min(intercept_s, slope_s) <= 0.0:
            return 0.0  # no fixed cost to amortise, or no cost a row to weigh it against
        if rows_per_s * (intercept_s + slope_s) < tuning.hold_load:
            return 0.0
        longest_s = tuning.hold_share * self.limits.max_latency_s
        rows = min(intercept_s / slope_s, cap, rows_per_s * longest_s)
        if rows_per_s * (intercept_s / rows + slope_s) > tuning.hold_load:
            return 0.0
        return rows / rows_per_s

    # --- decisions ------------------------------------------------------------------------

    def _oldest_limit(self) -> int:
        """The most rows a batch takes when refusing the oldest: the largest batch that ends
        within the limit at the high quantile, at most `max_batch_size`; the drops find the
        size the traffic fills by themselves (see `_shed_oldest`)."""
        costs, limits = self._costs, self.limits
        room_s = limits.max_latency_s - self._gaps.mean - costs.high_intercept_s
        if costs.high_slope_s <= 0.0:
            return limits.max_batch_size
        return max(1, min(limits.max_batch_size, int(room_s / costs.high_slope_s)))

    def _shed_oldest(self, now: float) -> tuple[tuple[Request, ...], float | None]:
        """Refuse the oldest requests of the next batch, as the queue makes it, while it would
        end past the oldest one's deadline, and likewise the oldest of each batch after it;
        and when to look again if nothing arrives (a batch running past its mean moves the
        next one's start). See docs/dispatcher.md, "Refusal modes".

        Refusing the oldest moves the deadline that binds the batch to the next request's,
        and shortens the batch by its rows, so one refusal is usually enough where refusing
        a newer request instead would shorten the batch by only one row's time. In overload
        the batch settles at the size whose rows the traffic brings within the limit, the
        overload branch of `best_cap`, without rounding it. Judging the later batches too
        refuses, as soon as the queue shows it, what waiting for the model would refuse a
        batch or two later. The probe (see `_admits`) is never refused: its batch corrects
        a cost model that would refuse everything. Nor is a request cut into pieces that the
        idle model was assured to finish: refused, it would be refused at every try.
        """
        waiting, busy = self._waiting, self._busy
        queue = waiting.requests
        if not queue:
            return (), None
        gap_s = self._gaps.high  # the model thread's wake: a slow one would make it late
        start = (now if busy.batch is None else self._next_start(now)[0]) + gap_s
        limit = self._oldest_limit()
        refused: list[Request] = []
        rows, finish, due = self._shed_from(0, start, limit, refused, now)
        shed_at = due - (finish - start) - gap_s if queue else None
        index, later = 0, start
        fit, tuning = self._costs.fit, self.tuning
        chain = max(tuning.shed_chain, 1.0 + tuning.shed_chain_spreads * fit.spread)
        while rows and waiting.only(queue[0].group):
            index = self._batch_ends(index, rows, limit)
            if index >= len(queue):
                break
            later += fit.mean(rows) * chain + self._gaps.mean
            rows, _, _ = self._shed_from(index, later, limit, refused, now)
        if refused:
            ahead = waiting.rows + (busy.batch.rows if busy.batch is not None else 0)
            self._refused(refused, finish, ahead, now)
        return tuple(refused), shed_at

    def _shed_from(
        self, index: int, start: float, limit: int, refused: list[Request], now: float
    ) -> tuple[int, float, float]:
        """Refuse the request at `index` while the batch it heads, starting at `start`, would
        end past its deadline; the rows that batch then takes, when it ends, and the deadline
        that binds it (`_binding`; infinite once no request is left).

        The batch is judged at its high quantile when more rows wait for it than it takes: a
        refusal then lets a younger request in, one surely in time. When it takes every row
        there is, refusing the oldest only shortens it by a row and loses its answer, and
        keeping a request that is likely on time serves more (`Tuning.shed_alone_k`). Likely
        leaves out the heavy tail, which slows a few batches in a hundred: counting it
        refused answers that nearly all came in time.
        """
        waiting, fit = self._waiting, self._costs.fit
        queue = waiting.requests
        alone = self._likely_factor()
        # Rows arriving before a later batch starts join it (FIFO); the next batch is judged
        # on the rows queued now, and again when the model frees.
        joining = self._rates.rows.rate(now) * (start - now) if index else 0.0
        while index < len(queue):
            head = queue[index]
            behind = waiting.group_rows.get(head.group, head.rows) - self._rows_before(index)
            rows = min(limit, behind + int(joining))
            finish = start + fit.mean(rows) * (fit.factor if behind + joining > limit else alone)
            binding = self._binding(index, rows)
            late = queue[binding]
            if head.id == waiting.probe or head.assured or finish <= late.deadline:
                return rows, finish, late.deadline
            del queue[binding]
            waiting.forget(late)
            refused.append(late)
        return 0, start, math.inf

    def _likely_factor(self) -> float:
        """The multiple of the mean line that `refuse: oldest` judges a batch taking every
        row on (see `_shed_from`)."""
        costs = self._costs
        normal = min(costs.margin, self.model.quantile_k * costs.fit.spread)
        return 1.0 + self.tuning.shed_alone_k / self.model.quantile_k * normal

    def _binding(self, index: int, rows: int) -> int:
        """The index of the request whose deadline binds the batch that the request at
        `index` heads and that takes `rows` rows: that request while deadlines are in arrival
        order; else the earliest deadline among the batch's members (its group's, FIFO, as
        `_take` makes it). Requests of one limit come in order, but API workers that keep back
        different reserves for the way home, or a client's own deadline, send them out of it:
        judged on its head alone, such a batch ends past a younger member's deadline."""
        waiting = self._waiting
        if waiting.ordered:
            return index
        queue = waiting.requests
        group = queue[index].group
        binding, taken = index, 0
        for at in range(index, len(queue)):
            request = queue[at]
            if request.group != group:
                continue
            if taken and taken + request.rows > rows:
                break
            taken += request.rows
            if request.deadline < queue[binding].deadline and not request.assured \
                    and request.id != waiting.probe:
                binding = at
        return binding

    def _rows_before(self, index: int) -> int:
        """The rows queued ahead of the request at `index` (0 or where a batch ends)."""
        if index == 0:
            return 0
        queue = self._waiting.requests
        if self._waiting.rows == len(queue):  # one row each: no need to count
            return index
        return sum(queue[i].rows for i in range(index))

    def _batch_ends(self, first: int, rows: int, limit: int) -> int:
        """The index of the first request after the batch that starts at index `first` and
        takes `rows` (FIFO, whole requests, at most `limit` rows: as `_take` makes it)."""
        queue = self._waiting.requests
        if self._waiting.rows == len(queue):
            return first + rows
        taken, index = 0, first
        while index < len(queue) and (index == first or taken + queue[index].rows <= limit):
            taken += queue[index].rows
            index += 1
        return index

    def _expire_head(self, now: float) -> tuple[Request, ...]:
        queue = self._waiting.requests
        if not queue or queue[0].deadline > now:
            return ()
        expired = []
        while queue and queue[0].deadline <= now:
            request = queue.popleft()
            self._waiting.forget(request)
            expired.append(request)
        return tuple(expired)

    def _decide(self, now: float) -> tuple[Reason | None, float | None]:
        """Release now (with why), or the time by which to look again."""
        rows, queue = self._waiting.rows, self._waiting.requests
        if self._waiting.closed:
            return "deadline", None
        bounded = len(queue) >= self.limits.request_bound
        if rows >= self.cap or bounded:
            full = self.cap >= self.limits.max_batch_size or bounded
            return ("full" if full else "cap"), None
        if rows >= self.target_rows or self.window_s <= 0.0:
            return "idle", None
        window_end = queue[0].arrival + self.window_s
        size = min(self.cap, max(rows, math.ceil(self.target_rows)))
        high_s = self._costs.high_intercept_s + self._costs.high_slope_s * size
        latest = min(r.deadline for r in queue) - high_s
        if now >= latest:
            return "deadline", None
        if now >= window_end:
            return "window", None
        return None, min(window_end, latest)

    def _take(self, now: float, reason: Reason) -> tuple[Batch | None, tuple[Request, ...]]:
        """Pop a batch FIFO up to the cap, dropping requests that would surely be late in it;
        a probe (see `_admits`) runs whatever the model says: it is there to correct it."""
        waiting, fit = self._waiting, self._costs.fit
        self._epoch += 1
        queue = waiting.requests
        limit = max(self.cap, waiting.next_rows)
        if self.oldest:
            limit = max(limit, self._oldest_limit())
        waiting.next_rows = 0
        if waiting.rows > limit and waiting.held_cap > limit:
            # Requests were admitted on the promise of a larger cap: keep it until they are out.
            limit = waiting.held_cap
        closed = waiting.take_closed()
        if closed:
            limit = closed
        intercept, slope = fit.intercept_s, fit.slope_s
        taken: list[Request] = []
        dropped: list[Request] = []
        passed: list[Request] = []  # other groups', kept in their places
        group = queue[0].group
        rows = 0
        wait = self._rates.queue_wait_s
        # Refusing the oldest, a batch grows no further than its members' earliest deadline
        # allows on the likely line: `_shed_from` keeps a head only if it is in time in the
        # batch it heads, but a head never refused (the probe, an assured piece) would be
        # made late by the rows that joined behind it.
        likely = self._likely_factor() if self.oldest else 0.0
        start, due = now + self._gaps.high, math.inf
        while queue:
            request = queue[0]
            if request.group != group:
                passed.append(queue.popleft())
                continue
            if taken and (rows + request.rows > limit or len(taken) >= self.limits.request_bound):
                break
            if likely:
                if taken and start + fit.mean(rows + request.rows) * likely > min(
                        due, request.deadline):
                    break
                due = min(due, request.deadline)
            queue.popleft()
            waiting.forget(request)
            late = request.deadline < now + intercept + slope * (rows + request.rows)
            if late and request.id != waiting.probe:
                dropped.append(request)
                continue
            taken.append(request)
            rows += request.rows
            wait += self.tuning.wait_memory * (now - request.arrival - wait)
        queue.extendleft(reversed(passed))
        self._rates.queue_wait_s = wait
        if waiting.rows <= self.cap:
            waiting.held_cap = self.cap
        if not taken:
            return None, tuple(dropped)
        batch = Batch(tuple(taken), reason, fit.high(rows))
        busy = self._busy
        busy.batch, busy.released = batch, now
        busy.mean_s = intercept + slope * rows
        busy.done_mean = now + busy.mean_s
        busy.stalled_at = now + self.tuning.stall_after * batch.predicted_s
        return batch, tuple(dropped)


class _Bound(NamedTuple):
    """The most a request joining the next batch is promised (`AdaptivePolicy._bound_next`):
    that batch's end holding `room` rows of `group`, for a next batch starting at `start`."""

    epoch: int
    group: tuple[str, ...]
    room: int
    finish: float
    start: float


class _Plan(NamedTuple):
    """Where a request joining the queue would run: its own batch's start (mean), the batches
    before it, the rows already queued for its own batch with its own, and that batch's
    room (`AdaptivePolicy._plan`)."""

    own_start: float
    sums: _Sums
    rest: int
    room: int


class _Sums:
    """Sums of squares and of `TAIL_INDEX` powers of batch means, for `_reserve`, and the
    batches and rows they hold, for the line's own error."""

    __slots__ = ("squares", "powers", "batches", "rows")

    def __init__(self, first_s: float, first_rows: int) -> None:
        self.squares = first_s * first_s
        self.powers = first_s**TAIL_INDEX
        self.batches = 1.0 if first_s > 0.0 else 0.0
        self.rows = float(first_rows)

    def add(self, mean_s: float, count: int, rows: float) -> None:
        """`count` batches of mean `mean_s`, `rows` rows each."""
        self.squares += count * mean_s * mean_s
        self.powers += count * mean_s**TAIL_INDEX
        self.batches += count
        self.rows += count * rows

    def plus(self, mean_s: float, rows: float) -> _Sums:
        """A copy with one more batch of mean `mean_s` and `rows` rows."""
        out = _Sums(0.0, 0)
        out.squares, out.powers = self.squares, self.powers
        out.batches, out.rows = self.batches, self.rows
        out.add(mean_s, 1, rows)
        return out

    def tail_norm(self) -> float:
        return float(self.powers ** (1.0 / TAIL_INDEX))


def best_cap(
    intercept_s: float, slope_s: float, rows_per_s: float, max_latency_s: float, limit: int
) -> int:
    """The batch size that maximises answers within the deadline, for a batch time that is a
    line, `intercept + slope * n`.

    Rows arriving while a batch of n runs (rate * (intercept + slope * n) of them) wait for it
    and then for their own batch. While they can all be served, the cap is the largest n with
    `(intercept + slope * n) + (intercept + slope * rate * (intercept + slope * n)) <= L`. In
    overload, bigger batches serve more per second but only requests arriving in the last
    `L - (intercept + slope * n)` seconds of a batch make the next one, which fills it when
    `n = rate * (L - intercept - slope * n)`. The larger of the two, in [1, limit]. The first
    is a bound, so it rounds down; the second is the rows the traffic brings on average, so it
    rounds to the nearest: below, a cap turns away the arrival that would make the next batch
    in time (`tight_12ms`, where it is 1.6 rows, served 2-3% fewer requests in time rounding
    down), and above, in overload on contended cores, batches grow longer than the tail
    leaves room for (`overload_contended` refused requests at their deadline rounding up).
    Derivation in docs/dispatcher.md.
    """
    rate, latency = rows_per_s, max_latency_s
    if slope_s > 0.0:
        keep_up = (latency - 2.0 * intercept_s - slope_s * rate * intercept_s) / (
            slope_s * (1.0 + slope_s * rate)
        )
    else:
        keep_up = float(limit)
    overload = rate * (latency - intercept_s) / (1.0 + rate * slope_s)
    if max(keep_up, overload) >= limit:
        return limit
    return max(math.floor(keep_up), math.floor(overload + 0.5), 1)
