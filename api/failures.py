"""What a runner's failure means to a client: the error each failure code is answered with.

A runner answers a call it cannot serve with a `Failure` and a code; the API worker answers
its client with the error of the same meaning (a refusal is a 503 with the runner's
Retry-After and what it judged on, a model call past its time limit a 504, ...), whether the
call was a request for that runner alone or a step of a pipeline (`outputs_of`, the one way
both turn a call's outcome into its outputs or its error).
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping

from ..runner.core.retry import retry_after_s
from ..runner.core.types import Tensors
from ..runner.core.wire import Failure, FailureCode
from .dispatch import RunnerFailure
from .errors import (
    BadRequest,
    BatchserveError,
    ModelTimeout,
    RunnerUnavailable,
    SloRefused,
    TooManyRows,
    Unavailable,
)
from .overload import Gate

__all__ = ["failure_error", "judged", "outputs_of"]


def outputs_of(runner: str, outcome: Tensors | Exception, waiting: MutableMapping[str, int],
               gate: Gate) -> Tensors:
    """A call to `runner` answered: it is out no longer (`waiting`); its outputs, or raises
    the error its client is answered with, a refusal told to the runner's `gate` first."""
    waiting[runner] -= 1
    if isinstance(outcome, RunnerFailure):
        if outcome.failure.code == FailureCode.REFUSED:
            gate.refused(time.monotonic())
        raise failure_error(runner, outcome)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def failure_error(runner: str, failure: RunnerFailure) -> BatchserveError:
    """What a runner's failure code means to an HTTP client."""
    detail = failure.failure
    retry = retry_after_s(detail.retry_after_s)
    if detail.code == FailureCode.INVALID:
        return BadRequest(detail.message)
    if detail.code == FailureCode.REFUSED:
        return SloRefused(runner, retry, judged(detail))
    if detail.code == FailureCode.EXPIRED:
        return Unavailable(detail.message, retry, "expired")
    if detail.code == FailureCode.STOPPING:
        return RunnerUnavailable(runner, retry)
    if detail.code == FailureCode.TIMEOUT:
        return ModelTimeout(detail.message)
    if detail.code == FailureCode.TOO_LARGE:
        return TooManyRows(detail.message)
    return BatchserveError(detail.message)


def judged(failure: Failure) -> dict[str, float]:
    """What a runner's refusal was judged on, for its 503 body (nothing when it does not say:
    a policy without a latency model)."""
    if failure.predicted_s <= 0.0:
        return {}
    return {"predicted_ms": round(failure.predicted_s * 1000, 1),
            "deadline_ms": round(failure.deadline_s * 1000, 1),
            "rows_ahead": failure.rows_ahead}
