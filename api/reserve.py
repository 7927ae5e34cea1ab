"""The time kept back from a request's limit for its answer's way home.

A runner answers by the deadline it is given. The answer then crosses the wire, waits its
turn on this worker's event loop and is encoded: under load that takes milliseconds, and in
overload, where every admitted request is served at the edge of its deadline, it would make
most answers late by exactly that much. So each API worker measures, per runner, how long
after the runner's deadline its answers leave (their *overrun*), and gives later requests
that much less time: the 99.8th percentile of the recent overruns, at most a quarter of the
limit. It measures only on this worker's clock, so it holds for runners on other hosts too.
"""

from __future__ import annotations

from ..runner.policy.latency_model import RecentQuantile

WINDOW = 2048  # overruns remembered
EVERY = 256  # new overruns between two estimates: sorting the window costs a few µs a request
# at 32; at 256 the estimate is still a fraction of a second old under load
QUANTILE = 0.998
MOST = 0.25  # of the limit, whatever is measured


class Reserve:
    """The recent high quantile of overruns: how much of the limit to keep back."""

    def __init__(self) -> None:
        self._overruns = RecentQuantile(WINDOW, EVERY, QUANTILE)

    def seconds(self, limit_s: float) -> float:
        return min(max(0.0, self._overruns.high), MOST * limit_s)

    def observe(self, overrun_s: float) -> None:
        """How long after the runner's deadline an answer left (negative: before it)."""
        self._overruns.add(overrun_s)
