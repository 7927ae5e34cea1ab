"""Shedding at the front: an API worker that falls behind turns requests away at once.

When the machine is short of CPU, requests wait in an API worker's socket buffers and event
loop before any of its code sees them, where no deadline can count them; served late, they
only make the wait longer for everyone behind. So each worker measures how late its own event
loop runs (`watch`: a timer every `Timeouts.LAG_PROBE_S` while requests are in flight), and
while that lag stays above its target it answers a growing share of new inference requests with 503
and Retry-After, before reading or decoding them; the share falls back as soon as the lag
does. A refusal costs a fraction of an answer, so shedding gives the CPU back to the
requests that are kept.

`Shedder` is the pure part (numbers in, a decision out); `watch` is the only part that
touches the event loop. In-flight requests are bounded as well (`api.max_inflight`), which
bounds a worker's memory whatever the cause of the backlog.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..runner.core.timeouts import Timeouts

DRAIN_TARGETS = 10.0
"""How many lag targets behind the loop counts as far behind (see `Shedder.drain_s`)."""
FORGOTTEN = 0.001
"""A gate's share below this is no share at all: the runner stopped refusing."""
MOST_SHED = 0.95
"""The largest share either controller turns away: some requests always reach the runner, so
the share keeps being measured against what it does."""
HOLDING = 0.75
"""A late tick holds the backlog when its lag is at least this share of the tick's before: a
loop working a burst off is late by less at each tick, one under a standing backlog about as
late, give or take the noise of a shared machine (at the onset of overload here: 18, 26, 26,
31, 26 and 58 ms)."""
ENGAGED = 0.1
"""A gate refuses nothing while its share is below this (some five refusals in quick
succession): a few refusals are the runner's own decisions at the margin, a stalled batch
say, which the runner explains better than the gate could; a standing overload soon passes it."""


@dataclass(slots=True)
class Shedder:
    """The share of new requests to turn away, driven by the measured loop lag.

    It acts on a standing backlog, not on a busy moment: only once every tick of the last
    `window_s` (100 ms), and at least `ticks` of them in a row, has been late by more than the
    target (a tenth of the tightest runner's limit, and at least `Timeouts.LAG_FLOOR_S`: 10 ms
    is no backlog to a 30 s limit), or `held` of them in a row without the lag falling by
    more than a quarter (`HOLDING`), does the share climb, by `rise_per_s` of the time each late
    tick took (from nothing to half the traffic in another 100 ms). It counts time, not
    ticks, because a late tick takes longer: counted in ticks, it would act slowest when the
    loop is furthest behind. On a timely tick the share falls in proportion to how far under
    the target the lag is (`fall_per_s` at no lag: a second from all to nothing), so it
    settles where the loop keeps up instead of swinging between shedding much and nothing.

    A loop that is busy in bursts but catches up between them, as under closed-loop clients
    whose requests in flight are bounded, has timely ticks in every window and sheds nothing
    (CoDel's rule for queues); so does a burst after a client's stall, whose backlog the loop
    works off within a few ticks, each later by less than the one before. Measured with 64
    closed-loop clients on the bundled `mlp`: a window of 30 ms shed 3 to 26 of about 35,000
    requests in some 10 s runs; a backlog that overload builds lasts seconds, so waiting
    100 ms to act on it costs little. Waiting for five ticks costs more: when overload
    begins, each tick is 20 to 60 ms late, so five took 150 to 250 ms, and every request read
    meanwhile was read, decoded and sent whole, or refused a hundred ms or more after it
    came; a lag that holds for three ticks is already a standing one.

    While it sheds, it also turns away every request read while the loop's next tick is
    overdue by more than the target (`due`, set by `watch`): such a request has waited at
    least that long unseen, and refusing it at once is what lets the loop catch up.
    """

    target_s: float = 0.010
    window_s: float = 0.1
    ticks: int = 5
    held: int = 3
    rise_per_s: float = 5.0
    fall_per_s: float = 1.0
    ceiling: float = MOST_SHED
    period_s: float = 0.01
    share: float = 0.0
    lag_s: float = 0.0
    late_s: float = 0.0  # how long every tick has been late, up to now
    late_ticks: int = 0  # and how many ticks that was
    holding: int = 0  # how many of them in a row held the lag (`HOLDING`)
    due: float = math.inf

    def observe(self, lag_s: float) -> None:
        took_s = self.period_s + lag_s
        previous, self.lag_s = self.lag_s, lag_s
        if lag_s > self.target_s:
            self.late_s += took_s
            self.late_ticks += 1
            self.holding = self.holding + 1 if lag_s >= HOLDING * previous else 0
            standing = self.late_ticks >= self.ticks or self.holding >= self.held
            if self.late_s >= self.window_s and standing:
                self.share = min(self.ceiling, self.share + self.rise_per_s * took_s)
        else:  # the further under the target, the faster: at the target it holds
            self.late_s, self.late_ticks, self.holding = 0.0, 0, 0
            spare = (self.target_s - lag_s) / self.target_s
            self.share = max(0.0, self.share - self.fall_per_s * spare * took_s)
        if lag_s > self.drain_s and previous > self.drain_s:
            # Far behind, twice in a row: the loop runs (period + lag) / period times slower
            # than its work arrives; turn away at once what it cannot catch up with.
            catch_up = 1.0 - (self.period_s + self.target_s) / took_s
            self.share = min(self.ceiling, max(self.share, catch_up))

    @property
    def drain_s(self) -> float:
        """The lag past which a backlog is no burst to ride out: at ten targets (the whole
        latency limit, for most runners) every request read now is late before it is
        decoded, and a wait for the shedder's window would grow the backlog for another
        window of late ticks."""
        return DRAIN_TARGETS * self.target_s

    def admits(self, draw: float, now: float) -> bool:
        """Whether a request with a uniform `draw` in [0, 1) is served. While shedding, none
        is served that the loop reads more than the target behind its next tick."""
        return draw >= self.share and now - self.due <= self.target_s

    def behind_s(self, now: float) -> float:
        """How late the loop runs: its last tick's lag, or more if the next is overdue."""
        return max(self.lag_s, now - self.due)


@dataclass(slots=True)
class Gate:
    """The share of one runner's new requests to refuse at the front while it refuses.

    A runner decides admission by deadlines, and a refusal means more is offered than it can
    take; but a request it refuses has cost its API worker a decode and a trip to the runner
    and back first, so in overload the refusals themselves eat the CPU the answers need. The
    gate turns the excess away at the front instead, before the body is read: every refusal
    from the runner raises the share by `step` of what is still admitted, and without
    refusals the share decays with time constant `tau_s`. At twice the runner's capacity it
    settles where the runner still refuses a few percent of what it gets (it keeps deciding
    at the margin, by deadlines) while the rest is refused for the cost of reading a header;
    when the overload ends the share is gone within a few `tau_s`.
    """

    step: float = 0.02
    tau_s: float = 0.1
    ceiling: float = MOST_SHED
    share: float = 0.0
    at: float = 0.0

    def _decay(self, now: float) -> None:
        if self.share and now > self.at:
            self.share *= math.exp((self.at - now) / self.tau_s)
            if self.share < FORGOTTEN:
                self.share = 0.0
        self.at = now

    def shares(self, now: float) -> float:
        """The share refused now: 0 below `ENGAGED`."""
        self._decay(now)
        return self.share if self.share >= ENGAGED else 0.0

    def refused(self, now: float) -> None:
        """The runner refused a request the gate let through."""
        self._decay(now)
        self.share = min(self.ceiling, self.share + self.step * (1.0 - self.share))

    def admits(self, draw: float, now: float) -> bool:
        """Whether a request with a uniform `draw` in [0, 1) goes on to the runner."""
        return self.share < ENGAGED or draw >= self.shares(now)


def backlog_s(share: float, behind_s: float) -> float:
    """How long the work a shedding worker refuses takes to serve, for its Retry-After: while
    it turns away `share` of what arrives and keeps up with the rest, each second refuses
    `share / (1 - share)` seconds of the work it can do (1 s at half the traffic shed, 4 s at
    four fifths), which the refused clients bring back; and the loop is `behind_s` late."""
    share = min(share, MOST_SHED)
    return share / (1.0 - share) + behind_s


async def watch(
    shedder: Shedder, busy: Callable[[], bool], woken: asyncio.Event,
    period_s: float = Timeouts.LAG_PROBE_S, clock: Callable[[], float] = time.monotonic,
    record: Callable[[float], None] | None = None,
    publish: Callable[[], None] | None = None, publish_s: float = Timeouts.PUBLISH_S,
) -> None:
    """Feed `shedder` the lag of this event loop, and `record` (the metric a user sees it
    by), for as long as the task runs; and call `publish` every `publish_s` meanwhile.

    It ticks only while `busy()` (requests in flight, or a share still shed): an idle worker
    sets no timer, and waits for `woken`, which every arrival sets. Going idle publishes once
    more, so what was published last is the idle state."""
    published = clock()
    while True:
        if not busy():
            if publish is not None:
                publish()
            woken.clear()
            await woken.wait()
        started = clock()
        shedder.due = started + period_s
        await asyncio.sleep(period_s)
        now = clock()
        shedder.due = math.inf
        lag_s = max(0.0, now - started - period_s)
        shedder.observe(lag_s)
        if record is not None:
            record(lag_s)
        if publish is not None and now - published >= publish_s:
            published = now
            publish()
