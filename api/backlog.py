"""Refusing in the API worker what a runner process would refuse, without asking it.

A runner process publishes with its answers how long a one-row request arriving then would
take, as its policy judges arrivals (`batchserve.runner.core.wire.Backlog`). An API worker
keeps the last word of each process it calls and lets it age: the backlog drains as the
clock runs. A request whose budget is shorter than what is left of that wait is refused here
(503, reason `backlog`; the runner would refuse it as `queue`) as soon as its headers are in,
before its body is read or decoded, and without a crossing to the runner and back.

What is left can only be less than what the runner would find: the published wait counts the
work the process held when it answered, not what came since from other workers, so a request
refused here would be refused there too; the rest the runner judges itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Published"]


@dataclass(slots=True)
class Published:
    """A runner process's last published wait and the rows it held, and when they were heard
    (monotonic seconds)."""

    wait_s: float = 0.0
    rows_ahead: int = 0
    heard: float = -math.inf

    def hear(self, wait_s: float, rows_ahead: int, now: float) -> None:
        self.wait_s, self.rows_ahead, self.heard = wait_s, rows_ahead, now

    def left_s(self, now: float) -> float:
        """What is left of the published wait at `now` (0 once it has drained)."""
        return max(0.0, self.wait_s - (now - self.heard))

    def refuses(self, budget_s: float, now: float) -> bool:
        """Whether a request with `budget_s` left would be refused by the process now."""
        return self.wait_s > 0.0 and self.left_s(now) > budget_s
