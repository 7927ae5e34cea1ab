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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

PERIOD_S = 0.01
"""How often a worker measures its loop's lag: 100 wake-ups a second, ~0.3% of a core."""
LAG_FLOOR_S = 0.010
"""The least lag that counts as falling behind, whatever the limits: below it, a loop on
shared cores is only waiting its turn for the scheduler."""


@dataclass(slots=True)
class Shedder:
    """The share of new requests to turn away, driven by the measured loop lag.

    It acts on a standing backlog, not on a busy moment: only while even the smallest lag of
    the last `window` ticks (100 ms) is over the target (a tenth of the tightest runner's
    limit, and at least `LAG_FLOOR_S`: 10 ms is no backlog to a 30 s limit) does the
    share climb, by `step_up` a tick (from nothing to half the traffic in another 100 ms); on a
    timely tick it falls by `step_down` (half a second from half to nothing). A loop that is
    busy in bursts but catches up between them, as under closed-loop clients whose requests
    in flight are bounded, has timely ticks in every window and sheds nothing (CoDel's rule
    for queues). Measured with 64 closed-loop clients on the bundled `mlp`: a window of 30 ms
    shed 3 to 26 of about 35,000 requests in some 10 s runs; a backlog that overload builds
    lasts seconds, so waiting 100 ms to act on it costs little.
    """

    target_s: float = 0.010
    window: int = 10
    step_up: float = 0.05
    step_down: float = 0.01
    ceiling: float = 0.95
    share: float = 0.0
    lag_s: float = 0.0
    recent: deque[float] = field(default_factory=deque)

    def observe(self, lag_s: float) -> None:
        self.lag_s = lag_s
        recent = self.recent
        recent.append(lag_s)
        if len(recent) > self.window:
            recent.popleft()
        if len(recent) == self.window and min(recent) > self.target_s:
            self.share = min(self.ceiling, self.share + self.step_up)
        elif lag_s <= self.target_s:
            self.share = max(0.0, self.share - self.step_down)

    def admits(self, draw: float) -> bool:
        """Whether a request with a uniform `draw` in [0, 1) is served."""
        return draw >= self.share


async def watch(
    shedder: Shedder, period_s: float = PERIOD_S, clock: Callable[[], float] = time.monotonic,
    record: Callable[[float], None] | None = None,
) -> None:
    """Feed `shedder` the lag of this event loop, and `record` (the metric a user sees it
    by), for as long as the task runs."""
    while True:
        started = clock()
        await asyncio.sleep(period_s)
        lag_s = max(0.0, clock() - started - period_s)
        shedder.observe(lag_s)
        if record is not None:
            record(lag_s)
