"""Shedding at the front: an API worker that falls behind turns requests away at once.

When the machine is short of CPU, requests wait in an API worker's socket buffers and event
loop before any of its code sees them, where no deadline can count them; served late, they
only make the wait longer for everyone behind. So each worker measures how late its own event
loop runs (`watch`: a timer every `PERIOD_S`), and while that lag stays above its target it
answers a growing share of new inference requests with 503 and Retry-After, before reading
or decoding them; the share falls back as soon as the lag does. A refusal costs a fraction
of an answer, so shedding gives the CPU back to the requests that are kept.

`Shedder` is the pure part (numbers in, a decision out); `watch` is the only part that
touches the event loop. In-flight requests are bounded as well (`api.max_inflight`), which
bounds a worker's memory whatever the cause of the backlog.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

PERIOD_S = 0.01
"""How often a worker measures its loop's lag: 100 wake-ups a second, ~0.3% of a core."""


@dataclass(slots=True)
class Shedder:
    """The share of new requests to turn away, driven by the measured loop lag.

    Additive steps both ways: `step_up` per late tick, from the second late tick in a row on
    (one late tick is a hiccup: a collection, a page fault), climbs from nothing to half the
    traffic in about 100 ms; `step_down` per timely tick lets it go in half a second. So a
    passing hiccup sheds nothing and a lasting overload is met within a tenth of a second.
    """

    target_s: float = 0.005
    step_up: float = 0.05
    step_down: float = 0.01
    ceiling: float = 0.95
    share: float = 0.0
    lag_s: float = 0.0
    late: int = 0

    def observe(self, lag_s: float) -> None:
        self.lag_s = lag_s
        self.late = self.late + 1 if lag_s > self.target_s else 0
        if self.late >= 2:
            self.share = min(self.ceiling, self.share + self.step_up)
        elif not self.late:
            self.share = max(0.0, self.share - self.step_down)

    def admits(self, draw: float) -> bool:
        """Whether a request with a uniform `draw` in [0, 1) is served."""
        return draw >= self.share


async def watch(
    shedder: Shedder, period_s: float = PERIOD_S, clock: Callable[[], float] = time.monotonic
) -> None:
    """Feed `shedder` the lag of this event loop, for as long as the task runs."""
    while True:
        started = clock()
        await asyncio.sleep(period_s)
        shedder.observe(max(0.0, clock() - started - period_s))
