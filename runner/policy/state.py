"""The adaptive policy's state, in small named parts.

`AdaptivePolicy` decides from a handful of facts: its limits, the requests waiting, the batch
on the model, the arrival rates, when it last refit, and the costs its latency model predicts
with. Each is one value here, so that a decision names the part it reads and a test can look
at one part alone. The parts hold state and keep it consistent; they decide nothing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .base import Batch, Request
from .latency_model import Fit, RateEstimator


@dataclass(frozen=True, slots=True)
class Limits:
    """What one batch may hold and how long a request may take: fixed for a runner's life.

    `max_batch_size` caps a batch in the units requests are sized in (`Request.rows`: rows, or
    elements for ragged inputs); `max_requests`, if given, also caps how many requests one
    batch holds (a runner's `max_batch_size` when it counts elements).
    """

    max_batch_size: int
    max_latency_s: float
    max_requests: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(
                f"max_batch_size has value {self.max_batch_size}; it must be at least 1")
        if self.max_latency_s <= 0:
            raise ValueError(
                f"max_latency_s has value {self.max_latency_s}; it must be positive")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(
                f"max_requests has value {self.max_requests}; it must be at least 1")

    @property
    def request_bound(self) -> float:
        """The most requests one batch holds (unbounded without `max_requests`)."""
        return math.inf if self.max_requests is None else self.max_requests


@dataclass(slots=True)
class Waiting:
    """The admitted requests not yet in a batch, in arrival order, with their rows counted in
    all and by group, and what they were promised."""

    requests: deque[Request] = field(default_factory=deque)
    rows: int = 0
    group_rows: dict[tuple[str, ...], int] = field(default_factory=dict)
    held_cap: int = 0
    """The largest cap a waiting request was admitted on: a batch keeps it until they are out."""
    next_rows: int = 0
    """Rows promised to the next batch, past the cap (`AdaptivePolicy._stretch_next`)."""
    closed: deque[int] = field(default_factory=deque)
    """The sizes of the batches at the head of the queue that no arrival may join, in order:
    each was closed when a request that would have made it end past a member's deadline
    was admitted to the batch after instead (`AdaptivePolicy._close_next`)."""
    closed_rows: int = 0
    """Their rows in all."""
    probe: int = -1
    """The id of the last request an idle model admitted on its cost curve alone."""
    ordered: bool = True
    """Every waiting request's deadline is at least that of the one before it (requests of
    one limit, as a runner's mostly are)."""

    def add(self, request: Request, cap: int) -> None:
        requests = self.requests
        if requests and request.deadline < requests[-1].deadline:
            self.ordered = False
        requests.append(request)
        self.rows += request.rows
        group = request.group
        self.group_rows[group] = self.group_rows.get(group, 0) + request.rows
        if cap > self.held_cap:
            self.held_cap = cap

    def forget(self, request: Request) -> None:
        """Uncount a request already taken out of `requests`."""
        self.rows -= request.rows
        left = self.group_rows[request.group] - request.rows
        if left:
            self.group_rows[request.group] = left
        else:
            del self.group_rows[request.group]
        if not self.requests:
            self.ordered = True
            self.closed.clear()
            self.closed_rows = 0

    def close(self) -> int:
        """Close the open batch at the back of the queue; its rows (0 if there were none)."""
        rows = self.rows - self.closed_rows
        if rows > 0:
            self.closed.append(rows)
            self.closed_rows += rows
        return rows

    def reopen(self) -> None:
        """Undo the last `close`."""
        self.closed_rows -= self.closed.pop()

    def take_closed(self) -> int:
        """The size the next batch was closed at (0 if it is open), no longer closed."""
        if not self.closed:
            return 0
        rows = self.closed.popleft()
        self.closed_rows -= rows
        return rows

    def earliest(self, group: tuple[str, ...], rows: int) -> float:
        """The earliest deadline among `group`'s newest requests holding `rows` rows: those
        of the batch a request joining the queue now would share. O(1) for requests of one
        row, one group and deadlines in order; else O(those requests)."""
        requests = self.requests
        if self.ordered and self.rows == len(requests) and self.only(group):
            return requests[-rows].deadline if 0 < rows <= len(requests) else math.inf
        earliest, left = math.inf, rows
        for request in reversed(requests):
            if request.group != group:
                continue
            earliest = min(earliest, request.deadline)
            left -= request.rows
            if left <= 0:
                break
        return earliest

    def only(self, group: tuple[str, ...]) -> bool:
        """Whether every waiting row is `group`'s (true of an empty queue too)."""
        return self.group_rows.get(group, 0) == self.rows


@dataclass(slots=True)
class Running:
    """The batch on the model and when it should end, and how the last one ended: what the
    next batch's start and the model's idle wait before it are read from."""

    batch: Batch | None = None
    released: float = 0.0
    """When the running batch was handed out."""
    mean_s: float = 0.0
    """Its mean time by the cost curve."""
    done_mean: float = 0.0
    """When it ends if it takes its mean time."""
    stalled_at: float = math.inf
    """When it counts as stalled (`Tuning.stall_after` times its high quantile)."""
    last_finished: float = 0.0
    """When the last batch ended."""
    just_completed: bool = False
    """The next poll follows a batch's end."""
    chained: bool = False
    """The running batch went out at once after the one before."""

    @property
    def rows(self) -> int:
        """The running batch's rows; 0 when the model is idle."""
        return 0 if self.batch is None else self.batch.rows


@dataclass(slots=True)
class Rates:
    """What arrives, as exponentially decaying rates, and how long requests waited lately."""

    requests: RateEstimator
    """Requests offered per second."""
    rows: RateEstimator
    """Rows offered per second."""
    admitted: RateEstimator
    """Rows admitted per second (refused rows never join a batch)."""
    admitted_now: RateEstimator
    """The same with a fifth of the memory, to see a step within milliseconds."""
    refused: RateEstimator
    """Rows refused per second, over `Tuning.refused_memory_s`: times that memory, the rows
    refused lately, which their clients will bring back."""
    queue_wait_s: float = 0.0
    """The moving average of queue wait over released requests."""

    @classmethod
    def with_memory(cls, tau_s: float, refused_s: float) -> Rates:
        return cls(RateEstimator(tau_s), RateEstimator(tau_s), RateEstimator(tau_s),
                   RateEstimator(tau_s / 5.0), RateEstimator(refused_s))


@dataclass(slots=True)
class Refits:
    """When the latency model was last refit, and what was measured since."""

    last: float = -math.inf
    fresh: int = 0
    """Batches measured since the last refit."""
    fresh_rows: int = 0
    """Rows in those batches."""
    shifted: bool = False
    """A batch since then said the machine changed: refit at once."""
    pending_since: float | None = None
    """When the refit handed out and not yet applied was handed out."""


@dataclass(frozen=True, slots=True)
class Costs:
    """A fit's numbers as the hot path uses them, worked out once per refit."""

    fit: Fit
    mean_intercept_s: float
    mean_slope_s: float
    high_intercept_s: float
    high_slope_s: float
    margin: float
    """How far the high quantile sits above the mean, as a share of the mean."""

    @classmethod
    def of(cls, fit: Fit) -> Costs:
        return cls(
            fit=fit,
            mean_intercept_s=fit.intercept_s,
            mean_slope_s=fit.slope_s,
            high_intercept_s=fit.intercept_s * fit.factor,
            high_slope_s=fit.slope_s * fit.factor,
            margin=fit.factor - 1.0,
        )
