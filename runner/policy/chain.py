"""A pipeline's one deadline, shared among its steps: arithmetic on predicted times.

Each step's predicted time is what is known of its runner when a request comes to it: for an
API worker, the wait its processes published with their last answers, never less than the
runner's time when idle (`batchserve.api.backlog.Published.expected_s`); for the simulator,
the same of the policies it runs (`batchserve.runner.sim.pipeline`). A request whose budget
is shorter than the sum over its steps is refused at the entrance: some step would make it
late, and every step run before finding out would be work thrown away. Each step is given
what is left of the request's deadline less the predicted time of the steps after it, so its
runner admits it against the time the chain can still spare it.

Pure code on numbers it is given: the live API worker and the simulator share it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["heaviest", "refuses", "step_budget_s"]


def refuses(predicted: Sequence[float], budget_s: float) -> bool:
    """Whether the steps, one after another, would not fit the budget."""
    return sum(predicted) > budget_s


def heaviest(predicted: Sequence[float]) -> int:
    """The step that weighs most: the one a refusal names (the first on a tie)."""
    return max(range(len(predicted)), key=lambda i: (predicted[i], -i))


def step_budget_s(left_s: float, predicted: Sequence[float], step: int) -> float:
    """The budget of step `step`: what is left of the deadline less the later steps' time."""
    return left_s - sum(predicted[step + 1:])
