"""Every timeout and grace period of the server's processes, in one frozen value.

The supervisor, the API workers and the runner processes all read their timing from the
`Timeouts` in their `Config` (the `timeouts:` key of `configuration.yml`), so the values a
stop depends on cannot drift apart: a process is only killed after its drain had time to
finish, and uvicorn's own graceful-shutdown wait is part of that drain, never added to it.

What stays elsewhere, and why:

- A runner's `batch_timeout_ms` (how long one model call may run) belongs to its model, so it
  stays per runner in `runners.NAME`; the API's wait for a call is derived from it and from
  the request's own deadline: `budget + batch_timeout + call_slack_s`.
- The adaptive policy's own periods (its refit cadence, the time constant of its rates) are
  part of its decisions and live in `batchserve.runner.policy.tuning.Tuning`.

The periods of the processes' own loops (how often the supervisor looks at its children, a
runner republishes its gauges, a worker probes its loop's lag) are not configuration: they are
fixed class constants of `Timeouts`, each with its reason, so every duration the server waits
on is still read from this one object.

A stop in time (SIGTERM to the supervisor at t = 0):

    0                      API workers: readiness and new requests 503; requests held finish
    ≤ drain_s              API workers exit (whatever is still waiting gets 503 "draining")
    ≤ kill_after_s         an API worker still alive is killed; the port is closed
    then ≤ drain_s more    runners finish what they hold and exit
    ≤ 2 × kill_after_s     the supervisor exits
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Durations in seconds (`ping_misses` is a count); see the module docstring."""

    drain_s: float = 5.0
    """After a stop signal, how long a process lets the requests it holds finish: an API worker
    the requests it accepted (uvicorn's graceful-shutdown timeout is what remains of this), a
    runner its queued and running batches. What is left then is answered 503."""
    kill_after_s: float = 8.0
    """How long the supervisor waits for a signalled process to exit before killing it; at
    least `drain_s + 1`, so a process is never killed while draining."""
    runner_start_s: float = 300.0
    """How long a runner may take to load and time its model before start-up fails."""
    api_start_s: float = 60.0
    """How long the API workers may take to answer their first readiness probe."""
    ping_period_s: float = 1.0
    """How often the supervisor pings each runner process."""
    ping_timeout_s: float = 2.0
    """How long a ping (and a start-up probe) may wait for its answer."""
    ping_misses: int = 3
    """Pings in a row a runner may miss before it is killed and replaced as hung."""
    restart_first_s: float = 0.5
    """Pause before restarting a child that died young; it doubles with each early death."""
    restart_max_s: float = 30.0
    """The longest pause before a restart."""
    stable_s: float = 60.0
    """A child that lived this long is restarted at once and its early deaths forgotten."""
    call_slack_s: float = 2.0
    """Beyond a call's deadline and its runner's batch timeout, how long an API worker waits
    for a runner before answering 503: it only bounds a runner that hangs as a whole."""
    reconnect_first_s: float = 0.05
    """First pause before an API worker reconnects to a runner; doubles with each failure."""
    reconnect_max_s: float = 1.0
    """The longest pause between reconnection attempts."""
    resolve_s: float = 5.0
    """How often an API worker resolves a runner's `dns+tcp:` name again, to connect to
    processes that appeared and let go of those that left; a connection error resolves it
    again at once."""
    keep_alive_s: float = 75.0
    """How long an API worker keeps an idle HTTP connection open (uvicorn's keep-alive).
    Longer than the idle timeout of common load balancers and client pools (60 s): the side
    that closes an idle connection first races a request sent on it, which then gets no
    answer, so that side should be the client's, which knows whether it is about to send."""
    hello_timeout_s: float = 5.0
    """How long either end of a new runner connection waits for the other's handshake before
    closing it, so a silent or foreign peer holds nothing for long; and the longest an API
    worker waits at start for a connection to each runner before it reports serving."""
    link_idle_s: float = 10.0
    """After this long with nothing heard from a runner, an API worker pings it, and drops the
    connection (and reconnects) when the ping is not answered within `ping_timeout_s`; a
    runner drops a connection silent for `ping_misses + 1` times this. It is also the idle
    time before TCP keepalive probes start."""

    # --- fixed periods: not configuration keys ---------------------------------------------

    EXIT_MARGIN_S: ClassVar[float] = 1.0
    """Time a process gets after its drain to close sockets and leave the interpreter: what
    `kill_after_s` must leave beyond `drain_s`."""
    POLL_S: ClassVar[float] = 0.05
    """How often the supervisor checks its children while they start; a signal wakes it at
    once, so this only bounds how soon a child's own readiness is seen."""
    WATCH_S: ClassVar[float] = 0.1
    """How often the supervisor's main loop looks for dead or hung children: a dead one is
    replaced, and its gauges dropped, within this of its death."""
    FLUSH_S: ClassVar[float] = 0.5
    """The least time uvicorn gets to write the last answers, even at the end of the grace
    period; it fits in the second a process has after its drain (`EXIT_MARGIN_S`)."""
    DRAIN_TICK_S: ClassVar[float] = 0.1
    """How often a draining API worker checks whether its requests are answered."""
    PUBLISH_S: ClassVar[float] = 1.0
    """How often a runner and a busy API worker republish their live gauges: a scrape sees
    state at most this old, and an idle runner's arrival rate decays to zero within a few
    periods of the last arrival."""
    GAUGE_PERIOD_S: ClassVar[float] = 0.1
    """The least time between two publications of a runner's gauges and tallies while batches
    run, so publishing costs next to nothing beside the batches."""
    LAG_PROBE_S: ClassVar[float] = 0.01
    """How often an API worker measures its loop's lag while requests are in flight: 100
    wake-ups a second, next to nothing beside the requests themselves, and none while idle."""
    LAG_FLOOR_S: ClassVar[float] = 0.010
    """The least loop lag that counts as falling behind, whatever the limits: below it, a loop
    on shared cores is only waiting its turn for the scheduler."""
    FRAME_WAIT_S: ClassVar[float] = 0.005
    """The longest a runner whose model has just come free puts off choosing the next batch
    for a call still coming in on a connection: a call of 600 KB crosses a unix socket's
    buffer in three reads, under a millisecond on idle cores and a few on busy ones, where
    the batch it would otherwise wait for takes tens."""
    HOLD_MAX_S: ClassVar[float] = 0.5
    """The longest a runner leaves a connection unread while its model runs a batch (it reads
    once the batch ends, or once it overruns its predicted time): a long batch must not keep
    a ping from its answer (`ping_timeout_s`)."""
    STATUS_POLL_S: ClassVar[float] = 0.01
    """How often a runner checks that its metrics and health server has started."""
    EXIT_DELAY_S: ClassVar[float] = 0.1
    """How long a runner whose model thread never came back waits, after answering what it
    held, before it exits: time for those answers to reach their sockets."""
    RETRY_AFTER_S: ClassVar[float] = 1.0
    """The least `Retry-After` an answer 503 carries (HTTP counts it in whole seconds, and 0
    would invite a storm of retries), and what a stopping runner suggests."""
    RETRY_AFTER_MAX_S: ClassVar[float] = 30.0
    """The most `Retry-After` a 503 computes (`batchserve.runner.core.retry`): beyond it the
    estimate is a guess about traffic that will have changed, and a client with a deadline
    gives up rather than wait longer."""
    RETRY_FLOOR_S: ClassVar[float] = 0.001
    """The least retry hint a runner's refusal carries, for a runner with a tiny limit."""
    CALL_WAIT_S: ClassVar[float] = 3600.0
    """How long past its budget a call waits for a runner when the caller gives no bound of
    its own (tools and tests; the API worker always gives `batch_timeout + call_slack_s`)."""

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "ping_misses":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(_wrong(item.name, value, "an integer >= 1"))
            elif isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value > 0
            ):
                raise ValueError(_wrong(item.name, value, "a positive number"))
        problem = self.inconsistency()
        if problem is not None:
            raise ValueError(problem)

    def inconsistency(self) -> str | None:
        """Why these values cannot work together, or None when they can."""
        margin = self.EXIT_MARGIN_S
        if self.kill_after_s < self.drain_s + margin:
            return _wrong(
                "kill_after_s", self.kill_after_s,
                f"at least timeouts.drain_s + {margin:g} "
                f"({self.drain_s + margin:g}), so a process is not killed while it "
                "drains",
            )
        for first, longest in (("restart_first_s", "restart_max_s"),
                               ("reconnect_first_s", "reconnect_max_s")):
            if getattr(self, first) > getattr(self, longest):
                return _wrong(first, getattr(self, first),
                              f"at most timeouts.{longest} ({getattr(self, longest):g})")
        return None

    def restart_pause(self, failures: int) -> float:
        """Seconds to wait before a restart after `failures` early deaths in a row."""
        if failures <= 0:
            return 0.0
        return float(min(self.restart_max_s, self.restart_first_s * 2 ** (failures - 1)))


def _wrong(name: str, value: object, expected: str) -> str:
    return f"timeouts.{name} has value {value!r}; it must be {expected}"
