"""Sending calls to runner processes: one persistent, multiplexed connection each.

Every API worker keeps one connection per runner process and picks a process for each
request among those connected, as the runner's `choice` says (`batchserve.api.choice`:
uniformly at random by default, or the less loaded of two drawn at random). A connection
that drops fails its calls in flight at once (503), and reconnects in the background, so a
restarted runner takes traffic again without anyone asking.

A draining runner refuses the calls it has not started (`draining`); those, and the calls
a dropped connection held unstarted, go once more to another process while their budget
lasts, so a runner that drains or goes away loses no request another process can take.

A connection counts as connected only once the handshake has passed
(`batchserve.runner.core.handshake`): a runner that speaks another protocol version, serves
another runner, or refuses (or cannot prove) the token stays unreachable, and requests for it
are answered 503 (`unreachable`) while the log says why. A connection nothing has come from
for `timeouts.link_idle_s` is pinged, and dropped when the ping goes unanswered.

A runner's processes are its static addresses, or those a `dns+tcp:` name resolves to
(`batchserve.api.discovery`): a process that appears gets a connection, and one that leaves
the name is taken out of the choice at once and its connection closed once the calls
it holds are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..runner.core.config import Choice
from ..runner.core.handshake import Refused, answer, welcomed
from ..runner.core.security import Credentials
from ..runner.core.timeouts import Timeouts
from ..runner.core.types import Tensors
from ..runner.core.wire import (
    Address,
    Backlog,
    Call,
    Failure,
    FailureCode,
    FrameReader,
    Hello,
    Message,
    Outbox,
    Ping,
    Result,
    Results,
    Started,
    WireError,
    decode,
    encode,
    tune,
)
from .backlog import Published
from .choice import CHOOSERS
from .discovery import Discovery, Resolver, resolve
from .errors import Unavailable

log = logging.getLogger(__name__)
_T = TypeVar("_T")
DEFAULT_TIMEOUTS = Timeouts()
NO_KEYS = Credentials()


class NotStarted(Unavailable):
    """The connection dropped before the call's batch went to the model: it may run elsewhere."""


class RunnerFailure(Exception):
    """A runner answered a call with a failure code instead of tensors."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


Answer = Callable[[Message | Exception], None]
"""Told a call's outcome exactly once: the runner's message, or why there is none."""


@dataclass(slots=True)
class _Waiting:
    """A call sent on a link: whom to tell, and when to give up on the runner."""

    answer: Answer
    deadline: float


def _tell(answer: Answer, outcome: Message | Exception) -> None:
    """Tell one caller; what it raises is its own bug and must not stop the others."""
    try:
        answer(outcome)
    except Exception:
        log.exception("answering a call failed")


class Link(asyncio.BufferedProtocol):
    """One connection to one runner process, with the calls waiting on it."""

    def __init__(
        self, runner: str, address: Address, timeouts: Timeouts = DEFAULT_TIMEOUTS,
        keys: Credentials = NO_KEYS, found_by: Discovery | None = None,
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.runner = runner
        self.changed = changed  # told when the link connects or drops
        self.address = address
        self.timeouts = timeouts
        self.keys = keys
        self.found_by = found_by  # the DNS name this process was found by, if any
        self.settled: asyncio.Event | None = None  # set when a call is settled, while leaving
        self.transport: asyncio.Transport | None = None  # set once the handshake passed
        self.outbox: Outbox | None = None
        self.pending: dict[int, _Waiting] = {}
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = math.inf
        self.started: set[int] = set()  # pending calls whose batch went to the model
        self.backlog = Published()  # the runner process's last published wait
        self.reader = FrameReader()
        self.next_id = 0
        self.lost = asyncio.Event()
        self.greeted = asyncio.Event()
        self.heard = 0.0
        self.peer: Hello | None = None  # the runner's Hello on the current connection
        self._opening: asyncio.Transport | None = None  # connected, handshake under way
        self._hello: Hello | None = None  # this end's Hello, sent
        self._trouble: str | None = None  # what was last logged about reaching the runner
        self.refused = False  # the last handshake failed on a check, not on the network

    @property
    def connected(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._opening = transport  # type: ignore[assignment]
        self._hello = self.peer = None
        self.reader = FrameReader()
        self.heard = time.monotonic()
        self.lost.clear()
        self.greeted.clear()
        self.refused = False
        tune(transport, self.timeouts.link_idle_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = self._opening = None
        pending, self.pending = self.pending, {}
        started, self.started = self.started, set()
        where = f"runner {self.runner!r} at {self.address}"
        ran = Unavailable(f"{where} went away while running the request")
        waited = NotStarted(f"{where} went away before running the request")
        self._disarm()
        for ident, waiting in pending.items():
            _tell(waiting.answer, ran if ident in started else waited)
        self.lost.set()
        self._settle()
        self.changed()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.heard = time.monotonic()
        try:
            for body in self.reader.buffer_updated(nbytes):
                message = decode(body)
                if self.transport is None:
                    self._greet(message)
                    continue
                if isinstance(message, Started):
                    self.started.update(c for c in message.calls if c in self.pending)
                    continue
                if isinstance(message, Backlog):
                    self.backlog.hear(message, self.heard)
                    continue
                if isinstance(message, Results):
                    for answer in message.answers():
                        self._answered(answer)
                    continue
                self._answered(message)
            if not self.pending:
                self._disarm()
            self._settle()
        except WireError as exc:
            log.error("runner %s at %s sent a bad frame: %s", self.runner, self.address, exc)
            self.close()

    def _answered(self, message: Message) -> None:
        """A call's answer, told to its waiter; unless the call was refused unstarted by a
        draining process, which another process may run."""
        waiting = self.pending.pop(message.id, None)
        if waiting is None:
            return
        refused = self._refused_unstarted(message)
        self.started.discard(message.id)
        _tell(waiting.answer, NotStarted(
            f"runner {self.runner!r} at {self.address} is stopping and did not "
            "run the request; retry shortly", 1.0, "draining") if refused else message)

    def _refused_unstarted(self, message: Message) -> bool:
        """A draining runner refused a call that never went to its model: another process
        may run it, so a drain loses nothing another process can take."""
        return (isinstance(message, Failure) and message.code == FailureCode.STOPPING
                and message.id not in self.started)

    def _greet(self, message: Message) -> None:
        """One step of the handshake: answer the runner's Hello, then check its Welcome."""
        opening = self._opening
        if opening is None or opening.is_closing():
            return
        token = self.keys.token
        try:
            if self._hello is None:
                self._hello = answer(message, self.runner, token)
                self.peer = message  # type: ignore[assignment]
                opening.writelines(encode(self._hello))
                return
            assert self.peer is not None
            welcomed(self.peer, self._hello, message, token)
        except Refused as exc:
            self.refused = True
            self.trouble(str(exc))
            opening.close()
            return
        self.transport, self._opening = opening, None
        self.backlog.full_batch = self.peer.max_batch_size
        self.outbox = Outbox(opening)
        self.greeted.set()
        self.changed()

    def close(self) -> None:
        for transport in (self.transport, self._opening):
            if transport is not None:
                transport.close()

    def trouble(self, why: str) -> None:
        """Log why the runner cannot be reached, once until that changes or it is reached."""
        if why != self._trouble:
            log.warning("runner %s at %s is unreachable: %s", self.runner, self.address, why)
            self._trouble = why

    def send(self, build: Callable[[int], Call | Ping], answer: Answer, deadline: float) -> None:
        """Send the message `build` makes for a fresh id; `answer` is told its outcome once,
        on the event loop, and a runner that has not answered by `deadline` (monotonic
        seconds) is given up on (503)."""
        if self.outbox is None or not self.connected:
            raise Unavailable(f"runner {self.runner!r} at {self.address} is not connected")
        self.next_id += 1
        ident = self.next_id
        self.pending[ident] = _Waiting(answer, deadline)
        self.outbox.put(build(ident))
        if deadline < self._expiry_at:
            self._arm(deadline)

    async def call(self, build: Callable[[int], Call | Ping]) -> Message:
        """Send the message `build` makes for a fresh id and wait for its answer (for pings
        and tools; the request path uses `send`)."""
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.send(build, functools.partial(_settle, future), math.inf)
        ident = self.next_id
        try:
            return await future
        finally:  # cancelled by a caller's timeout: forget the call
            if self.pending.pop(ident, None) is not None:
                self.started.discard(ident)
                self._settle()

    def _arm(self, at: float) -> None:
        """Wake at `at` to give up on calls past their deadline (none is armed while the link
        holds no call: an idle link sets no timer)."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = at
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_at(loop.time() + max(0.0, at - time.monotonic()), self._expire)

    def _disarm(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry, self._expiry_at = None, math.inf

    def _expire(self) -> None:
        """Answer 503 for every call whose runner is past its deadline; wake again at the next."""
        self._expiry, self._expiry_at = None, math.inf
        now = time.monotonic()
        late = [ident for ident, waiting in self.pending.items() if waiting.deadline <= now]
        for ident in late:
            waiting = self.pending.pop(ident)
            self.started.discard(ident)
            _tell(waiting.answer, Unavailable(f"runner {self.runner!r} did not answer in time"))
        soonest = min((waiting.deadline for waiting in self.pending.values()), default=math.inf)
        if soonest < math.inf:
            self._arm(soonest)
        if late:
            self._settle()

    def _settle(self) -> None:
        if self.settled is not None:
            self.settled.set()

    async def maintain(self) -> None:
        """Keep this link connected for as long as the task runs."""
        first, longest = self.timeouts.reconnect_first_s, self.timeouts.reconnect_max_s
        tls = self.keys.client_context(self.address)
        # A certificate names the DNS name the process was found by, not its pod's IP.
        name = self.keys.server_name(self.address if self.found_by is None
                                     else self.found_by.address)
        pause = first
        while True:
            try:  # bounded: a host that drops packets would hold a connect for minutes
                async with asyncio.timeout(self.timeouts.hello_timeout_s):
                    await self.address.connect(lambda: self, tls, name)
            except OSError as exc:  # refused, unreachable, timed out, or TLS failed
                self.trouble(str(exc) or f"no connection within "
                             f"{self.timeouts.hello_timeout_s:g} s")
                if self.found_by is not None:  # the process may have left the name
                    self.found_by.again()
                await asyncio.sleep(pause)
                pause = min(pause * 2, longest)
                continue
            if not await self._handshake():
                # A refusal (version, runner, token) mends only when one side is restarted.
                await asyncio.sleep(self.timeouts.link_idle_s if self.refused else pause)
                pause = min(pause * 2, longest)
                continue
            pause = first
            await self._keep()

    async def _handshake(self) -> bool:
        """Wait for the handshake to pass; False (and the connection closed) if it did not."""
        limit = self.timeouts.hello_timeout_s
        done = asyncio.ensure_future(self.greeted.wait())
        gone = asyncio.ensure_future(self.lost.wait())
        try:
            await asyncio.wait((done, gone), timeout=limit,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            gone.cancel()
        if self.greeted.is_set() and self.connected:
            assert self.peer is not None
            log.info("connected to runner %s at %s (protocol %d, max_batch_size %d)",
                     self.runner, self.address, self.peer.version, self.peer.max_batch_size)
            self._trouble = None
            return True
        if not self.lost.is_set():
            self.trouble(f"no handshake within {limit:g} s")
            self.close()
        elif not self.refused:
            self.trouble("it closed the connection during the handshake (TLS refused, or "
                         "not a runner)")
        await self.lost.wait()
        return False

    async def _keep(self) -> None:
        """Until the connection is lost: ping it when nothing was heard for a while, and
        drop it when the ping goes unanswered."""
        idle = self.timeouts.link_idle_s
        while not self.lost.is_set():
            quiet = time.monotonic() - self.heard
            if quiet < idle:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(idle - quiet):
                        await self.lost.wait()
                continue
            try:
                async with asyncio.timeout(self.timeouts.ping_timeout_s):
                    await self.call(Ping)
            except TimeoutError:
                log.warning("runner %s at %s did not answer a ping within %g s; reconnecting",
                            self.runner, self.address, self.timeouts.ping_timeout_s)
                if self.transport is not None:
                    self.transport.abort()
                await self.lost.wait()
            except Unavailable:
                await self.lost.wait()
        log.warning("runner %s at %s: the connection was lost; reconnecting",
                    self.runner, self.address)

    async def leave(self) -> None:
        """Close once every call in flight is answered (each is bounded by its caller's
        timeout), without taking new ones: the process left the runner."""
        self.settled = asyncio.Event()
        while self.pending and self.connected:
            self.settled.clear()
            await self.settled.wait()
        self.close()

    def abandon(self, error: Exception) -> None:
        """Fail every call still waiting on this link with `error` (the caller gives up)."""
        pending, self.pending = self.pending, {}
        self.started.clear()
        self._disarm()
        for waiting in pending.values():
            _tell(waiting.answer, error)
        self._settle()


class Pool:
    """The processes of one runner, as seen from one API worker: its static addresses, and
    those its `dns+tcp:` names resolve to now."""

    def __init__(
        self, runner: str, addresses: Sequence[Address], timeouts: Timeouts = DEFAULT_TIMEOUTS,
        keys: Credentials = NO_KEYS, resolver: Resolver = resolve,
        choice: Choice = "random", rng: random.Random | None = None,
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.runner = runner
        self.changed = changed  # told when a process connects, drops, comes or goes
        self.front_s = 0.0  # what this API worker spends per request lately: every call says
        self.choose = CHOOSERS[choice]
        self.rng = rng or random.Random()
        self.timeouts = timeouts
        self.keys = keys
        self.links = [Link(runner, a, timeouts, keys, changed=changed)
                      for a in addresses if not a.discovered]
        self.names = [Discovery(runner, a, timeouts.resolve_s, resolver)
                      for a in addresses if a.discovered]
        self._found: dict[Address, dict[Address, Link]] = {d.address: {} for d in self.names}
        self._tasks: dict[Link, asyncio.Task[None]] = {}
        self._watches: list[asyncio.Task[None]] = []
        self._leaving: dict[Link, asyncio.Task[None]] = {}

    def start(self) -> None:
        for link in self.links:
            self._tasks[link] = asyncio.create_task(link.maintain())
        self._watches = [
            asyncio.create_task(name.watch(functools.partial(self.update, name)))
            for name in self.names
        ]

    def update(self, name: Discovery, found: frozenset[Address]) -> None:
        """Connect to the processes `name` now has, and let go of those it no longer has."""
        have = self._found[name.address]
        if found == have.keys():
            return
        for address in found - have.keys():
            link = have[address] = Link(self.runner, address, self.timeouts, self.keys, name,
                                        self.changed)
            self.links.append(link)
            self._tasks[link] = asyncio.create_task(link.maintain())
        for address in have.keys() - found:
            self._retire(have.pop(address))
        log.info("runner %s: %s has %d process(es): %s", self.runner, name.address, len(found),
                 ", ".join(sorted(str(a) for a in found)) or "none")
        self.changed()

    def _retire(self, link: Link) -> None:
        """Out of the choice now; closed once the calls it holds are answered."""
        self.links.remove(link)
        self._tasks.pop(link).cancel()  # no more reconnecting or pinging
        task = self._leaving[link] = asyncio.create_task(link.leave())
        task.add_done_callback(lambda _: self._leaving.pop(link, None))

    async def close(self) -> None:
        links = [*self.links, *self._leaving]
        tasks = [*self._watches, *self._tasks.values(), *self._leaving.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in links:
            link.close()

    @property
    def ready(self) -> bool:
        return any(link.connected for link in self.links)

    def abandon(self, error: Exception) -> None:
        """Fail every call in flight to this runner with `error`."""
        for link in [*self.links, *self._leaving]:
            link.abandon(error)

    def pick(self, besides: Link | None = None) -> Link:
        """A connected process (other than `besides`), as the runner's `choice` says."""
        if besides is None and len(self.links) == 1 and self.links[0].connected:
            return self.links[0]  # one process: nothing to choose
        links = self._connected(besides)
        if not links:
            raise Unavailable(f"no process of runner {self.runner!r} is reachable")
        return links[self.choose(len(links), lambda i: len(links[i].pending), self.rng)]

    def least_backlog(self, now: float) -> Published | None:
        """The backlog of the connected process whose published wait leaves the most time
        at `now`, judged before a process is picked: a request every process would refuse is
        refused as soon as its headers are in."""
        backlogs = [link.backlog for link in self.links if link.connected]
        return min(backlogs, key=lambda backlog: backlog.left_s(now), default=None)

    def _connected(self, besides: Link | None = None) -> list[Link]:
        return [link for link in self.links if link.connected and link is not besides]

    def submit(
        self, tensors: Tensors, rows: int, budget_s: float, group: tuple[str, ...],
        wait_s: float, done: Done, spent_s: float = 0.0, link: Link | None = None,
    ) -> None:
        """Call a process with `tensors` of `rows` rows, checked against the signature; `done`
        is told the outputs or the exception, once, on the event loop. If the process goes
        away before running the call, it goes once more to another while the budget lasts (a
        call that had started is never run twice). A runner silent for `wait_s` past the
        budget is given up on: only a process that hangs as a whole gets that far. `spent_s`
        is what the request cost before (its decoding), which the runner counts against the
        limit when it judges whether the request could ever fit. `link` is the process the
        caller picked for it (and judged its backlog by), if any."""
        _Sent(self, tensors, rows, budget_s, group, wait_s, done, spent_s).go(
            self.pick() if link is None else link)

    async def infer(
        self, tensors: Tensors, rows: int, budget_s: float, group: tuple[str, ...] = (),
        wait_s: float = Timeouts.CALL_WAIT_S,
    ) -> Tensors:
        """`submit`, awaited."""
        future: asyncio.Future[Tensors] = asyncio.get_running_loop().create_future()
        self.submit(tensors, rows, budget_s, group, wait_s,
                    lambda outcome, _spare_s: _settle(future, outcome))
        return await future


def _settle(future: asyncio.Future[_T], outcome: _T | Exception) -> None:
    """Settle `future` with a callback's outcome, or the exception standing for it; once (a
    caller that gave up has cancelled it already)."""
    if future.done():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


Done = Callable[[Tensors | Exception, float], None]
"""Told a request's outputs, or the exception that stands for its failure, and how long
before the call's deadline the runner's batch ended (`Result.spare_s`; 0 for a failure)."""


class _Sent:
    """One request on its way to a runner process, and at most once more to another."""

    __slots__ = ("pool", "tensors", "rows", "budget_s", "group", "wait_s", "done", "spent_s",
                 "link", "sent", "again")

    def __init__(self, pool: Pool, tensors: Tensors, rows: int, budget_s: float,
                 group: tuple[str, ...], wait_s: float, done: Done, spent_s: float) -> None:
        self.pool, self.tensors, self.rows, self.group = pool, tensors, rows, group
        self.budget_s, self.wait_s, self.done, self.spent_s = budget_s, wait_s, done, spent_s
        self.link: Link | None = None
        self.sent = 0.0
        self.again = False

    def go(self, link: Link) -> None:
        self.link, self.sent = link, time.monotonic()
        link.send(self.build, self.answer, self.sent + self.budget_s + self.wait_s)
        link.backlog.sent(self.rows)

    def build(self, ident: int) -> Call:
        return Call(ident, self.budget_s, self.rows, self.tensors, self.group, self.spent_s,
                    self.pool.front_s, self.sent)

    def answer(self, outcome: Message | Exception) -> None:
        if isinstance(outcome, Result):
            self.done(outcome.tensors, outcome.spare_s)
        elif isinstance(outcome, Failure):
            self.done(RunnerFailure(outcome), 0.0)
        elif isinstance(outcome, NotStarted) and self._retry():
            return
        elif isinstance(outcome, Exception):
            self.done(outcome, 0.0)
        else:
            self.done(WireError(f"runner {self.pool.runner!r} answered a call with "
                                f"{type(outcome).__name__}"), 0.0)

    def _retry(self) -> bool:
        """Send a call no process started to another one, once, while its budget lasts."""
        pool, link = self.pool, self.link
        left = self.budget_s - (time.monotonic() - self.sent)
        if self.again or left <= 0 or not pool._connected(besides=link):
            return False
        log.info("runner %s: a call not started on %s goes to another process",
                 pool.runner, link.address if link is not None else "?")
        self.again, self.budget_s = True, left
        try:
            self.go(pool.pick(besides=link))
        except Unavailable as exc:
            self.done(exc, 0.0)
        return True


__all__ = ["FailureCode", "Link", "NotStarted", "Pool", "RunnerFailure"]
