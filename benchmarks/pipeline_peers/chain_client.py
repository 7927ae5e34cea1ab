"""An open-loop client that calls two models one after the other, as a user chains them.

Each request, at its scheduled time, asks the first model; when that answers 200 the client
builds the second call from the answer (`follow`) and sends it on the same connection. Its
latency runs from its scheduled time to the second answer, so it is the two calls' sum plus
what the client spent between them. The schedule (`traffic.schedule`) and the timer thread
that fires it are batchserve's own generator's (`batchserve.api.bench.loadgen`); the pool
is the same (keep-alive connections, one request in flight on each, a client-side queue when
all are busy). It differs in one thing: it reads each answer's body, which the generator
never does, since the second call is made of it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from batchserve.api.bench.http1 import ProtocolError, encode_request
from batchserve.api.bench.load_result import TIMEOUT, TRANSPORT_ERROR, LoadResult, summarize
from batchserve.api.bench.loadgen import _tick  # the generator's own timer thread
from batchserve.api.bench.traffic import schedule

HEADERS = {"Content-Type": "application/json"}
Follow = Callable[[bytes], bytes]
"""The second call's body, made from the first call's answer."""


@dataclass(frozen=True)
class ChainResult:
    """What the client saw: `load` over each request's last status and whole latency (a
    request is good when both calls answered 200 within the limit), and how many first
    calls were answered 200 (their rows ran, whatever the second call did)."""

    load: LoadResult
    first_ok: int


class BodyParser:
    """HTTP/1.1 answers framed by Content-Length, as (status, body) pairs."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._status = 0
        self._length = -1

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buf += data
        done: list[tuple[int, bytes]] = []
        while True:
            if self._length < 0:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    return done
                self._head(bytes(self._buf[:end]))
                del self._buf[: end + 4]
            if len(self._buf) < self._length:
                return done
            done.append((self._status, bytes(self._buf[: self._length])))
            del self._buf[: self._length]
            self._length = -1

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ProtocolError(f"bad status line {lines[0]!r}")
        self._status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                self._length = int(value)
        if self._length < 0:
            raise ProtocolError("response without Content-Length")


class _Connection(asyncio.Protocol):
    def __init__(self, run: _Run) -> None:
        self.run = run
        self.parser = BodyParser()
        self.transport: asyncio.Transport | None = None
        self.index = -1
        self.step = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def send(self, index: int, step: int, request: bytes) -> None:
        self.index, self.step = index, step
        cast(asyncio.Transport, self.transport).write(request)

    def data_received(self, data: bytes) -> None:
        try:
            answers = self.parser.feed(data)
        except (ProtocolError, ValueError):
            self.abort()
            return
        for status, body in answers:
            self.run.answered(self, status, body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.run.lost(self)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class _Run:
    def __init__(self, urls: tuple[str, str], body: bytes, follow: Follow,
                 offsets: list[float], max_connections: int) -> None:
        first, second = (urlsplit(url) for url in urls)
        self.host, self.port = first.hostname or "127.0.0.1", first.port or 80
        self.first = encode_request("POST", first.path, first.netloc, HEADERS, body)
        self.second_path, self.netloc = second.path, second.netloc
        self.follow = follow
        self.offsets = offsets
        n = len(offsets)
        self.latencies, self.statuses, self.lags = [0.0] * n, [TIMEOUT] * n, [0.0] * n
        self.first_ok = 0
        self.remaining = n
        self.all_done = asyncio.Event()
        self.all_fired = asyncio.Event()
        self.idle: list[_Connection] = []
        self.conns: set[_Connection] = set()
        self.queued: deque[int] = deque()
        self.max_connections = max_connections
        self.connecting = 0
        self.peak_connections = self.peak_queued = 0
        self.start = self.last_done = 0.0
        self.fired = 0
        self.closing = False
        self.tasks: set[asyncio.Task[None]] = set()

    def fire_upto(self, end: int) -> None:
        now = time.perf_counter() - self.start
        for index in range(self.fired, end):
            self.lags[index] = now - self.offsets[index]
            self.fire(index)
        self.fired = max(self.fired, end)
        if self.fired == len(self.offsets):
            self.all_fired.set()

    def fire(self, index: int) -> None:
        if self.idle:
            self.idle.pop().send(index, 0, self.first)
            return
        self.queued.append(index)
        self.peak_queued = max(self.peak_queued, len(self.queued))
        if len(self.conns) + self.connecting < self.max_connections:
            self.open()

    def answered(self, conn: _Connection, status: int, body: bytes) -> None:
        index, step = conn.index, conn.step
        if step == 0 and status == 200:
            self.first_ok += 1
            try:
                request = encode_request("POST", self.second_path, self.netloc, HEADERS,
                                         self.follow(body))
            except (KeyError, IndexError, TypeError, ValueError):
                self.complete(index, TRANSPORT_ERROR)
            else:
                conn.send(index, 1, request)
                return
        else:
            self.complete(index, status)
        self.release(conn)

    def complete(self, index: int, status: int) -> None:
        if self.closing:
            return
        now = time.perf_counter()
        self.latencies[index] = now - self.start - self.offsets[index]
        self.statuses[index] = status
        self.last_done = now
        self.remaining -= 1
        if self.remaining == 0:
            self.all_done.set()

    def release(self, conn: _Connection) -> None:
        conn.index = -1
        if self.queued and not self.closing:
            conn.send(self.queued.popleft(), 0, self.first)
        else:
            self.idle.append(conn)

    def lost(self, conn: _Connection) -> None:
        self.conns.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)
        if conn.index >= 0:
            self.complete(conn.index, TRANSPORT_ERROR)
            conn.index = -1

    def open(self) -> None:
        self.connecting += 1
        task = asyncio.get_running_loop().create_task(self.connect())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host,
                                                   self.port)
        except OSError:
            self.connecting -= 1
            if self.queued and not self.closing:
                self.complete(self.queued.popleft(), TRANSPORT_ERROR)
            return
        self.connecting -= 1
        self.conns.add(conn)
        self.peak_connections = max(self.peak_connections, len(self.conns))
        self.release(conn)

    async def close(self) -> None:
        self.closing = True
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for conn in list(self.conns):
            conn.abort()
        await asyncio.sleep(0)


async def run_chain(urls: tuple[str, str], body: bytes, follow: Follow, rate: float,
                    seconds: float, seed: int = 0, *, slo_ms: float = 100.0,
                    max_connections: int = 256, drain_timeout: float = 5.0) -> ChainResult:
    """Send ``body`` to ``urls[0]`` at Poisson arrivals of ``rate``/s for ``seconds``, and
    each 200's ``follow(answer)`` to ``urls[1]``."""
    run = _Run(urls, body, follow, schedule(rate, seconds, seed, "poisson"), max_connections)
    if not run.offsets:
        run.all_done.set()
        run.all_fired.set()
    cpu0 = time.process_time()
    for _ in range(8):  # connections opened before the clock starts, as the generator does
        run.connecting += 1
        await run.connect()
    stop = threading.Event()
    run.start = time.perf_counter()
    ticker = threading.Thread(target=_tick, name="chain-ticker", daemon=True, args=(
        asyncio.get_running_loop(), run.start, run.offsets, run.fire_upto, stop))
    ticker.start()
    try:
        await run.all_fired.wait()
        stop.set()
        await asyncio.to_thread(ticker.join)
        try:
            await asyncio.wait_for(run.all_done.wait(), drain_timeout)
        except TimeoutError:
            pass
    finally:
        stop.set()
        await run.close()
    elapsed = run.last_done - run.start if run.last_done else seconds
    load = summarize(rate, seconds, run.latencies, run.statuses, run.lags, elapsed,
                     (run.peak_connections, run.peak_queued), time.process_time() - cpu0,
                     slo_ms=slo_ms)
    return ChainResult(load, run.first_ok)
