"""A predicted drain time as the whole seconds of a Retry-After."""

from __future__ import annotations

import math

import pytest

from batchserve.runner.core.retry import retry_after_s
from batchserve.runner.core.timeouts import Timeouts


@pytest.mark.parametrize(("drain_s", "seconds"), [
    (0.0, 1.0),  # never 0: that would invite every client back at once
    (-2.0, 1.0),
    (0.2, 1.0),
    (1.0, 1.0),
    (1.01, 2.0),  # rounded up: a client told less would find the backlog still there
    (4.3, 5.0),
    (45.0, Timeouts.RETRY_AFTER_MAX_S),
    (math.inf, Timeouts.RETRY_AFTER_MAX_S),
])
def test_retry_after_is_the_drain_time_rounded_up_to_whole_seconds_within_bounds(
    drain_s: float, seconds: float
) -> None:
    assert retry_after_s(drain_s) == seconds
