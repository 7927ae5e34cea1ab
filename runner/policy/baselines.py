"""Baseline policies the adaptive one is measured against (docs/dispatcher.md).

- `FixedPolicy`: Triton-like; release when the cap is reached or the oldest request has waited
  the window. No early refusal, and late requests are still served.
- `NoBatchingPolicy`: one request per batch, as soon as the model is free.
- `BentoMLPolicy`: BentoML's dispatcher rule as read in its source, re-implemented here as an
  honest baseline.

All honour the same contract as `batchserve.runner.policy.adaptive.AdaptivePolicy`, so the
simulator drives them the same way.
"""

from __future__ import annotations

from collections import deque

from .base import Batch, PolicyStats, Reason, Request, Step, WithoutModel, take_in_order


class FixedPolicy(WithoutModel):
    """Release at `cap` rows or once the oldest request has waited `window_s`."""

    def __init__(
        self,
        max_batch_size: int,
        max_latency_s: float,
        *,
        window_s: float = 0.005,
        cap: int | None = None,
    ) -> None:
        self.cap = max_batch_size if cap is None else min(cap, max_batch_size)
        if self.cap < 1:
            raise ValueError(f"cap has value {cap}; it must be at least 1")
        if window_s < 0:
            raise ValueError(f"window_s has value {window_s}; it must not be negative")
        self.window_s = window_s
        self.queue: deque[Request] = deque()
        self.queued_rows = 0
        self.busy = False

    def offer(self, request: Request, now: float) -> bool:
        self.queue.append(request)
        self.queued_rows += request.rows
        return True

    def poll(self, now: float) -> Step:
        if self.busy or not self.queue:
            return Step()
        if self.queued_rows >= self.cap:
            return Step(batch=self._take("full"))
        release_at = self.queue[0].arrival + self.window_s
        if now >= release_at:
            return Step(batch=self._take("window"))
        return Step(wake_at=release_at)

    def _take(self, reason: Reason) -> Batch:
        taken, rows = take_in_order(self.queue, self.cap)
        self.queued_rows -= rows
        self.busy = True
        return Batch(taken, reason)

    def complete(
        self, batch: Batch, started: float, finished: float, cpu_s: float | None = None
    ) -> None:
        self.busy = False

    def stats(self, now: float) -> PolicyStats:
        return PolicyStats(
            window_s=self.window_s,
            cap=self.cap,
            intercept_s=0.0,
            slope_s=0.0,
            p99_batch_s=0.0,
            arrival_rps=0.0,
            queued=len(self.queue),
        )


class NoBatchingPolicy(FixedPolicy):
    """One request at a time: the latency floor at low load, the throughput floor under load."""

    def __init__(self, max_batch_size: int, max_latency_s: float) -> None:
        super().__init__(max_batch_size, max_latency_s, window_s=0.0, cap=1)


TICK_S = 0.001
HISTORY = 50
REFIT_EVERY_S = 5.0
WARMUP_GREEDY = 10
WARMUP_TARGETS = (1, 2, 3)


class BentoMLPolicy(WithoutModel):
    """BentoML's adaptive dispatcher rule.

    It predicts a batch of n requests to take `slope_s * n + intercept_s`, fitted by least
    squares over the last batches, and dispatches once waiting longer would not pay. Counts
    jobs (requests), not rows, as BentoML does. One deviation: a request that does not fit the
    remaining room of a batch is left for the next batch rather than split, since the live
    runner splits oversized requests before they reach any policy.
    """

    def __init__(self, max_batch_size: int, max_latency_s: float) -> None:
        self.max_batch_size = max_batch_size
        self.latency = max_latency_s
        self.slope_s = min(2.0, 2.0 * max_latency_s / 30.0)
        self.intercept_s = min(1.0, max_latency_s / 30.0)
        self.mean_wait = 0.0
        self.queue: deque[Request] = deque()
        self.history: deque[tuple[int, float, float]] = deque(maxlen=HISTORY)
        self.busy = False
        self.batches = 0
        self.last_fit: float | None = None
        self._pending_wait = 0.0

    def offer(self, request: Request, now: float) -> bool:
        self.queue.append(request)
        return True

    def poll(self, now: float) -> Step:
        expired: list[Request] = []
        queue = self.queue
        while queue:
            n = len(queue)
            w0 = now - queue[0].arrival
            if n > 1 and w0 + self.slope_s * n + self.intercept_s >= self.latency:
                expired.append(queue.popleft())
                continue
            if self.busy:
                if n == 1 and w0 >= self.latency:
                    expired.append(queue.popleft())
                    continue
                return Step(expired=tuple(expired), wake_at=now + TICK_S)
            size = self._ready_size(now, n)
            if size is None:
                return Step(expired=tuple(expired), wake_at=now + TICK_S)
            return Step(batch=self._take(now, size), expired=tuple(expired))
        return Step(expired=tuple(expired))

    def _ready_size(self, now: float, n: int) -> int | None:
        """How many rows to dispatch now, or None to sleep a tick."""
        if self.batches < WARMUP_GREEDY:
            return self.max_batch_size
        warm = self.batches - WARMUP_GREEDY
        if warm < len(WARMUP_TARGETS):
            # A lone request would wait for its warm-up partners for ever at low load; we let
            # it go once it could not wait longer (not in BentoML's rule, but needed to end).
            target = WARMUP_TARGETS[warm]
            w0 = now - self.queue[0].arrival
            ready = n >= target or w0 + self.slope_s * target + self.intercept_s >= self.latency
            return target if ready else None
        wn = now - self.queue[-1].arrival
        if n < self.max_batch_size and n * (wn + TICK_S + self.slope_s) <= 0.95 * self.mean_wait:
            return None
        return self.max_batch_size

    def _take(self, now: float, size: int) -> Batch:
        warming = self.batches < WARMUP_GREEDY + len(WARMUP_TARGETS)
        self._pending_wait = 0.0 if warming else now - self.queue[0].arrival
        taken: list[Request] = []
        rows = 0
        while self.queue and (not taken or rows + self.queue[0].rows <= size):
            request = self.queue.popleft()
            taken.append(request)
            rows += request.rows
        self.busy = True
        return Batch(tuple(taken), "idle")

    def complete(
        self, batch: Batch, started: float, finished: float, cpu_s: float | None = None
    ) -> None:
        self.busy = False
        self.batches += 1
        self.history.append((len(batch.requests), finished - started, self._pending_wait))
        warm = self.batches - WARMUP_GREEDY
        if 0 < warm <= len(WARMUP_TARGETS) or self._fit_due(finished):
            self._fit(finished)

    def _fit_due(self, now: float) -> bool:
        if self.batches <= WARMUP_GREEDY + len(WARMUP_TARGETS):
            return False
        return self.last_fit is None or now - self.last_fit >= REFIT_EVERY_S

    def _fit(self, now: float) -> None:
        """Least squares of duration on (n, 1), as BentoML does: no weights, no robustness."""
        if len(self.history) <= 2:
            return
        self.last_fit = now
        count = len(self.history)
        mean_n = sum(n for n, _, _ in self.history) / count
        mean_t = sum(t for _, t, _ in self.history) / count
        var_n = sum((n - mean_n) ** 2 for n, _, _ in self.history)
        cov = sum((n - mean_n) * (t - mean_t) for n, t, _ in self.history)
        if var_n > 0:
            slope = cov / var_n
            intercept = mean_t - slope * mean_n
        else:
            # numpy's lstsq gives the minimum-norm solution when every n is equal: the time is
            # split between slope and intercept in the ratio n : 1, whatever the true cost is:
            # a weakness of the rule, kept so the baseline stays faithful.
            slope = mean_t * mean_n / (mean_n**2 + 1.0)
            intercept = mean_t / (mean_n**2 + 1.0)
        self.slope_s = max(1e-6, slope)
        self.intercept_s = max(0.0, intercept)
        self.mean_wait = sum(w for _, _, w in self.history) / count

    def stats(self, now: float) -> PolicyStats:
        return PolicyStats(
            window_s=0.0,
            cap=self.max_batch_size,
            intercept_s=self.intercept_s,
            slope_s=self.slope_s,
            p99_batch_s=0.0,
            arrival_rps=0.0,
            queued=len(self.queue),
        )
