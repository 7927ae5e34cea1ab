"""An open-loop client that calls two models one after the other, as a user chains them.

Each request, at its scheduled time, asks the first model; when that answers 200 the client
builds the second call from the answer (`follow`) and sends it on the same connection. Its
latency runs from its scheduled time to the second answer, so it is the two calls' sum plus
what the client spent between them. The schedule (`traffic.schedule`) and the timer thread
that fires it, and the pool (keep-alive connections, one request in flight on each, a
client-side queue when all are busy), are batchserve's own generator's
(`batchserve.api.bench.loadgen`), subclassed. It differs in one thing: it reads each answer's
body, which the generator never does, since the second call is made of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from batchserve.api.bench.http1 import ProtocolError, Target, encode_request
from batchserve.api.bench.load_result import TRANSPORT_ERROR, LoadResult
from batchserve.api.bench.loadgen import Connection, Run, drive
from batchserve.api.bench.traffic import schedule

HEADERS = {"Content-Type": "application/json"}
WARM_CONNECTIONS = 8
"""Connections opened before the clock starts, as the generator does."""
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


class _Connection(Connection):
    """The generator's connection, reading each answer's body: the second call is made of
    the first's answer."""

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.chain = cast(_ChainRun, run)
        self.parser = BodyParser()
        self.step = 0

    def send(self, index: int, request: bytes | None = None) -> None:
        """The first call of request `index`, or its second (`request`)."""
        self.step = 0 if request is None else 1
        if request is None:
            super().send(index)
            return
        self.in_flight = index
        cast(asyncio.Transport, self.transport).write(request)

    def data_received(self, data: bytes) -> None:
        try:
            answers = self.parser.feed(data)
        except (ProtocolError, ValueError):
            self.abort()
            return
        for status, body in answers:
            if self.in_flight < 0:  # an answer nobody asked for: the stream is out of step
                self.abort()
                return
            self.chain.answered(self, status, body)


class _ChainRun(Run):
    """The generator's run, with each first answer followed by the second call."""

    connection = _Connection

    def __init__(self, urls: tuple[str, str], body: bytes, follow: Follow,
                 offsets: list[float], max_connections: int) -> None:
        super().__init__(Target.from_url(urls[0], body, HEADERS), offsets, max_connections)
        second = urlsplit(urls[1])
        self.second_path, self.netloc = second.path, second.netloc
        self.follow = follow
        self.first_ok = 0

    def answered(self, conn: _Connection, status: int, body: bytes) -> None:
        index, conn.in_flight = conn.in_flight, -1
        if conn.step == 0 and status == 200:
            self.first_ok += 1
            try:
                request = encode_request("POST", self.second_path, self.netloc, HEADERS,
                                         self.follow(body))
            except (KeyError, IndexError, TypeError, ValueError):
                self.complete(index, TRANSPORT_ERROR)
            else:
                conn.send(index, request)
                return
        else:
            self.complete(index, status)
        self.release(conn)


async def run_chain(urls: tuple[str, str], body: bytes, follow: Follow, rate: float,
                    seconds: float, seed: int = 0, *, slo_ms: float = 100.0,
                    max_connections: int = 256, drain_timeout: float = 5.0) -> ChainResult:
    """Send ``body`` to ``urls[0]`` at Poisson arrivals of ``rate``/s for ``seconds``, and
    each 200's ``follow(answer)`` to ``urls[1]``."""
    run = _ChainRun(urls, body, follow, schedule(rate, seconds, seed, "poisson"),
                    max_connections)
    cpu = await drive(run, WARM_CONNECTIONS, drain_timeout)
    return ChainResult(run.result(rate, seconds, cpu, slo_ms, drain_timeout), run.first_ok)
