"""Sending calls to runner processes: one persistent, multiplexed connection each.

Every API worker keeps one connection per runner process and picks a process for each
request among those connected, as the runner's `choice` says (`batchserve.api.choice`:
uniformly at random by default, or the less loaded of two drawn at random). A connection
that drops fails its calls in flight at once (503), and reconnects in the background, so a
restarted runner takes traffic again without anyone asking.

A draining runner refuses the calls it has not started (`stopping`); those, and the calls
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
import random
import time
from collections.abc import Callable, Sequence

from ..runner.core.config import Choice
from ..runner.core.handshake import Refused, answer, welcomed
from ..runner.core.security import Credentials
from ..runner.core.timeouts import Timeouts
from ..runner.core.types import Tensors
from ..runner.core.wire import (
    Address,
    Call,
    Failure,
    FailureCode,
    FrameReader,
    Hello,
    Message,
    Outbox,
    Ping,
    Result,
    Started,
    WireError,
    decode,
    encode,
    tune,
)
from .choice import CHOOSERS
from .discovery import Discovery, Resolver, resolve
from .errors import Unavailable

log = logging.getLogger(__name__)
DEFAULT_TIMEOUTS = Timeouts()
NO_KEYS = Credentials()


class NotStarted(Unavailable):
    """The connection dropped before the call's batch went to the model: it may run elsewhere."""


class RunnerFailure(Exception):
    """A runner answered a call with a failure code instead of tensors."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class Link(asyncio.BufferedProtocol):
    """One connection to one runner process, with the calls waiting on it."""

    def __init__(
        self, runner: str, address: Address, timeouts: Timeouts = DEFAULT_TIMEOUTS,
        keys: Credentials = NO_KEYS, found_by: Discovery | None = None,
    ) -> None:
        self.runner = runner
        self.address = address
        self.timeouts = timeouts
        self.keys = keys
        self.found_by = found_by  # the DNS name this process was found by, if any
        self.settled = asyncio.Event()  # a call was answered or given up
        self.transport: asyncio.Transport | None = None  # set once the handshake passed
        self.outbox: Outbox | None = None
        self.pending: dict[int, asyncio.Future[Message]] = {}
        self.started: set[int] = set()  # pending calls whose batch went to the model
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
        for ident, future in pending.items():
            if not future.done():
                future.set_exception(ran if ident in started else waited)
        self.lost.set()
        self.settled.set()

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
                future = self.pending.pop(message.id, None)
                if future is None or future.done():
                    continue
                if self._refused_unstarted(message):
                    future.set_exception(NotStarted(
                        f"runner {self.runner!r} at {self.address} is stopping and did not "
                        "run the request; retry shortly", 1.0, "stopping"))
                else:
                    future.set_result(message)
        except WireError as exc:
            log.error("runner %s at %s sent a bad frame: %s", self.runner, self.address, exc)
            self.close()

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
        self.outbox = Outbox(opening)
        self.greeted.set()

    def close(self) -> None:
        for transport in (self.transport, self._opening):
            if transport is not None:
                transport.close()

    def trouble(self, why: str) -> None:
        """Log why the runner cannot be reached, once until that changes or it is reached."""
        if why != self._trouble:
            log.warning("runner %s at %s is unreachable: %s", self.runner, self.address, why)
            self._trouble = why

    async def call(self, build: Callable[[int], Call | Ping]) -> Message:
        """Send the message `build` makes for a fresh id and wait for its answer."""
        if self.outbox is None or not self.connected:
            raise Unavailable(f"runner {self.runner!r} at {self.address} is not connected")
        self.next_id += 1
        ident = self.next_id
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Message] = loop.create_future()
        self.pending[ident] = future
        self.outbox.put(build(ident))
        try:
            return await future
        finally:  # cancelled by a caller's timeout: forget the call
            self.pending.pop(ident, None)
            self.started.discard(ident)
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
        while self.pending and self.connected:
            self.settled.clear()
            await self.settled.wait()
        self.close()

    def abandon(self, error: Exception) -> None:
        """Fail every call still waiting on this link with `error` (the caller gives up)."""
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)


class Pool:
    """The processes of one runner, as seen from one API worker: its static addresses, and
    those its `dns+tcp:` names resolve to now."""

    def __init__(
        self, runner: str, addresses: Sequence[Address], timeouts: Timeouts = DEFAULT_TIMEOUTS,
        keys: Credentials = NO_KEYS, resolver: Resolver = resolve,
        choice: Choice = "random", rng: random.Random | None = None,
    ) -> None:
        self.runner = runner
        self.choose = CHOOSERS[choice]
        self.rng = rng or random.Random()
        self.timeouts = timeouts
        self.keys = keys
        self.links = [Link(runner, a, timeouts, keys) for a in addresses if not a.discovered]
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
            link = have[address] = Link(self.runner, address, self.timeouts, self.keys, name)
            self.links.append(link)
            self._tasks[link] = asyncio.create_task(link.maintain())
        for address in have.keys() - found:
            self._retire(have.pop(address))
        log.info("runner %s: %s has %d process(es): %s", self.runner, name.address, len(found),
                 ", ".join(sorted(str(a) for a in found)) or "none")

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
        links = self._connected(besides)
        if not links:
            raise Unavailable(f"no process of runner {self.runner!r} is reachable")
        return links[self.choose(len(links), lambda i: len(links[i].pending), self.rng)]

    def _connected(self, besides: Link | None = None) -> list[Link]:
        return [link for link in self.links if link.connected and link is not besides]

    async def infer(
        self, tensors: Tensors, rows: int, budget_s: float, group: tuple[str, ...] = ()
    ) -> Tensors:
        """Call a process with `tensors` of `rows` rows, checked against the signature; if it
        goes away before running the call, once more on another while the budget lasts (a
        call that had started is never run twice)."""
        link = self.pick()
        sent = time.monotonic()
        try:
            message = await link.call(lambda ident: Call(ident, budget_s, rows, tensors, group))
        except NotStarted:
            left = budget_s - (time.monotonic() - sent)
            if left <= 0 or not self._connected(besides=link):
                raise
            log.info("runner %s: a call not started on %s goes to another process",
                     self.runner, link.address)
            message = await self.pick(besides=link).call(
                lambda ident: Call(ident, left, rows, tensors, group))
        if isinstance(message, Result):
            return message.tensors
        if isinstance(message, Failure):
            raise RunnerFailure(message)
        raise WireError(f"runner {self.runner!r} answered a call with {type(message).__name__}")


__all__ = ["FailureCode", "Link", "NotStarted", "Pool", "RunnerFailure"]
