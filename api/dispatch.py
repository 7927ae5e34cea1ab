"""Sending calls to runner processes: one persistent, multiplexed connection each.

Every API worker keeps one connection per runner process and picks a process uniformly at
random for each request, among those connected. A connection that drops fails its calls in
flight at once (503), and reconnects in the background, so a restarted runner takes
traffic again without anyone asking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence

from batchserve.api.errors import Unavailable
from batchserve.runner.timeouts import Timeouts
from batchserve.runner.types import Tensors
from batchserve.runner.wire import (
    Address,
    Call,
    Failure,
    FailureCode,
    FrameReader,
    Message,
    Outbox,
    Ping,
    Result,
    Started,
    WireError,
    decode,
)

log = logging.getLogger(__name__)
DEFAULT_TIMEOUTS = Timeouts()


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
        self, runner: str, address: Address, timeouts: Timeouts = DEFAULT_TIMEOUTS
    ) -> None:
        self.runner = runner
        self.address = address
        self.timeouts = timeouts
        self.transport: asyncio.Transport | None = None
        self.outbox: Outbox | None = None
        self.pending: dict[int, asyncio.Future[Message]] = {}
        self.started: set[int] = set()  # pending calls whose batch went to the model
        self.reader = FrameReader()
        self.next_id = 0
        self.lost = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.outbox = Outbox(self.transport)  # type: ignore[arg-type]
        self.reader = FrameReader()
        self.lost.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        pending, self.pending = self.pending, {}
        started, self.started = self.started, set()
        where = f"runner {self.runner!r} at {self.address}"
        ran = Unavailable(f"{where} went away while running the request")
        waited = NotStarted(f"{where} went away before running the request")
        for ident, future in pending.items():
            if not future.done():
                future.set_exception(ran if ident in started else waited)
        self.lost.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            for body in self.reader.buffer_updated(nbytes):
                message = decode(body)
                if isinstance(message, Started):
                    self.started.update(c for c in message.calls if c in self.pending)
                    continue
                future = self.pending.pop(message.id, None)
                if future is not None and not future.done():
                    future.set_result(message)
        except WireError as exc:
            log.error("runner %s at %s sent a bad frame: %s", self.runner, self.address, exc)
            if self.transport is not None:
                self.transport.close()

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

    async def maintain(self) -> None:
        """Keep this link connected for as long as the task runs."""
        first, longest = self.timeouts.reconnect_first_s, self.timeouts.reconnect_max_s
        pause = first
        while True:
            try:
                await self.address.connect(lambda: self)
            except OSError:
                await asyncio.sleep(pause)
                pause = min(pause * 2, longest)
                continue
            pause = first
            await self.lost.wait()

    def abandon(self, error: Exception) -> None:
        """Fail every call still waiting on this link with `error` (the caller gives up)."""
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)


class Pool:
    """The processes of one runner, as seen from one API worker."""

    def __init__(
        self, runner: str, addresses: Sequence[Address], timeouts: Timeouts = DEFAULT_TIMEOUTS
    ) -> None:
        self.runner = runner
        self.links = [Link(runner, address, timeouts) for address in addresses]
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(link.maintain()) for link in self.links]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in self.links:
            if link.transport is not None:
                link.transport.close()

    @property
    def ready(self) -> bool:
        return any(link.connected for link in self.links)

    def abandon(self, error: Exception) -> None:
        """Fail every call in flight to this runner with `error`."""
        for link in self.links:
            link.abandon(error)

    def pick(self, besides: Link | None = None) -> Link:
        """A connected process (other than `besides`), uniformly at random."""
        links = [link for link in self.links if link.connected and link is not besides]
        if not links:
            raise Unavailable(f"no process of runner {self.runner!r} is reachable")
        return links[0] if len(links) == 1 else random.choice(links)

    async def infer(self, tensors: Tensors, rows: int, budget_s: float) -> Tensors:
        """Call a process with `tensors` of `rows` rows, checked against the signature; if it
        goes away before running the call, once more on another while the budget lasts (a
        call that had started is never run twice)."""
        link = self.pick()
        sent = time.monotonic()
        try:
            message = await link.call(lambda ident: Call(ident, budget_s, rows, tensors))
        except NotStarted:
            left = budget_s - (time.monotonic() - sent)
            if left <= 0 or not any(o.connected and o is not link for o in self.links):
                raise
            log.info("runner %s: a call not started on %s goes to another process",
                     self.runner, link.address)
            message = await self.pick(besides=link).call(
                lambda ident: Call(ident, left, rows, tensors))
        if isinstance(message, Result):
            return message.tensors
        if isinstance(message, Failure):
            raise RunnerFailure(message)
        raise WireError(f"runner {self.runner!r} answered a call with {type(message).__name__}")


__all__ = ["FailureCode", "Link", "NotStarted", "Pool", "RunnerFailure"]
