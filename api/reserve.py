"""The time kept back from a request's limit for its answer's way home.

A runner answers by the deadline it is given. The answer then crosses the wire, waits its
turn on this worker's event loop behind the other answers of its batch and is encoded: under
load that takes milliseconds, and a request the runner served at the edge of its deadline is
late by exactly that much. So each API worker learns, per runner, how late each answer would
have left had its batch ended at its deadline: how late past its deadline it left, plus how
long before the deadline its batch ended (`Result.spare_s`, which the runner sends with it).
That is its way home, and all of the runner's own lateness besides: every answer measures
it, early or late, whoever's clock is ahead. Later requests get that much less time: the
99th percentile of it, lately, at most a quarter of the limit. A request is late by it only
if it was served at the edge of its deadline and its way home was among the longest, and
those at the edge are the oldest of their batch, answered first. A higher quantile costs
more than it saves: on a 12 ms limit the 99.8th kept back so much that an eighth fewer
requests were answered in time, for a few tenths of a percent less lateness.

Counted only as how late answers left, the early ones, most of them, would teach nothing:
the reserve would stay at nothing until late answers had filled the quantile, and fall back
once they left the window, letting through the lateness it is there to prevent.
"""

from __future__ import annotations

import math

from ..runner.policy.latency_model import RecentQuantile

WINDOW = 2048  # ways home remembered
EVERY = 256  # new ones between two estimates: sorting the window costs a few µs a request
# at 32; at 256 the estimate is still a fraction of a second old under load
QUANTILE = 0.99
MOST = 0.25  # of the limit, whatever is measured


class Reserve:
    """The recent high quantile of the answers' ways home: how much of the limit to keep
    back."""

    def __init__(self) -> None:
        self._ways = RecentQuantile(WINDOW, EVERY, QUANTILE)

    def seconds(self, limit_s: float) -> float:
        return min(max(0.0, self._ways.high), MOST * limit_s)

    def answered(self, overrun_s: float, spare_s: float) -> None:
        """An answer left `overrun_s` after the deadline the runner was given (negative:
        before it); its batch ended `spare_s` before that deadline (negative: after it, and
        then its overrun, the runner's lateness with it, is what counts). A spare that is
        no number (a peer's bad frame) teaches nothing."""
        way_s = overrun_s + max(spare_s, 0.0)
        if math.isfinite(way_s):
            self._ways.add(way_s)
