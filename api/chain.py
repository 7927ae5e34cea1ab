"""A pipeline's steps as an API worker predicts them: from the backlogs their processes
published. What the chain does with the predicted times (refusing at the entrance, each step's
share of the deadline) is `batchserve.runner.policy.chain`, which the simulator shares.

Each step's predicted time is the wait its processes published with their last answers, as it
drains with the clock, and never less than the runner's time when idle
(`batchserve.api.backlog.Published.expected_s`). Pure code on a clock it is given: the tests
drive it with made-up backlogs and times.
"""

from __future__ import annotations

from collections.abc import Sequence

from .backlog import Published

__all__ = ["predict"]


def predict(backlogs: Sequence[Published | None], now: float) -> tuple[float, ...]:
    """Each step's predicted time at `now` (0 for a runner with no process connected: the
    step is refused when it is sent, not judged here)."""
    return tuple(0.0 if backlog is None else backlog.expected_s(now) for backlog in backlogs)
