"""A worker takes every connection waiting at one wake, not one per turn of its event loop.

Counted in turns of a real uvloop loop: a callback that schedules itself again runs once a
turn. A busy worker's turn is 10 to 20 ms, so a turn a connection is a second for a client's
pool of a hundred."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvicorn
import uvloop

from batchserve.api.http import acceptor as acceptor_module
from batchserve.api.http.acceptor import Acceptor
from batchserve.api.worker import DrainingServer

WAITING = 300
"""Connections opened while nobody accepts: the kernel completes them and queues them."""


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


@pytest.fixture
def queued() -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    """A listening socket and the `WAITING` connections queued on it, none accepted yet."""
    sock = _listening()
    pool = [socket.create_connection(sock.getsockname(), timeout=10) for _ in range(WAITING)]
    yield sock, pool
    for client in pool:
        client.close()
    sock.close()


class _Turns:
    """Counts turns of the running loop until `until()` holds."""

    def __init__(self, until: Callable[[], bool]) -> None:
        self.until = until
        self.count = 0
        self.done = asyncio.get_running_loop().create_future()

    def tick(self) -> None:
        if self.until():
            self.done.set_result(self.count)
            return
        self.count += 1
        if self.count > 10 * WAITING:
            self.done.set_exception(AssertionError("the connections were never accepted"))
            return
        asyncio.get_running_loop().call_soon(self.tick)

    async def wait(self) -> int:
        self.tick()
        return await asyncio.wait_for(self.done, 30)


def _run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


class _Counted(asyncio.Protocol):
    """A connection that says when it is made, and no more."""

    def __init__(self, made: list[asyncio.BaseTransport],
                 told: Callable[[], None] = lambda: None) -> None:
        self.made, self.told = made, told

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)
        self.told()


def _close(transports: list[asyncio.BaseTransport]) -> None:
    for transport in transports:
        transport.close()


def test_a_pool_opened_at_once_is_accepted_within_a_few_turns(
        queued: tuple[socket.socket, list[socket.socket]]) -> None:
    sock, _ = queued
    made: list[asyncio.BaseTransport] = []

    async def main() -> int:
        acceptor = Acceptor(sock, lambda: _Counted(made))
        turns = await _Turns(lambda: len(made) == WAITING).wait()
        acceptor.close()
        await acceptor.wait_closed()
        _close(made)
        return turns

    turns = _run(main)
    assert turns <= 4, f"{turns} turns to take {WAITING} waiting connections"


def test_uvloops_own_server_takes_a_turn_a_connection(
        queued: tuple[socket.socket, list[socket.socket]]) -> None:
    # Why the acceptor exists: libuv accepts one connection per turn of the loop. If this
    # fails, uvloop accepts in bursts again and the acceptor may go.
    sock, _ = queued
    made: list[asyncio.BaseTransport] = []

    async def main() -> int:
        server = await asyncio.get_running_loop().create_server(lambda: _Counted(made), sock=sock)
        turns = await _Turns(lambda: len(made) == WAITING).wait()
        server.close()
        _close(made)
        return turns

    turns = _run(main)
    assert turns >= WAITING // 2, f"uvloop took {WAITING} connections in {turns} turns"


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


def test_the_worker_serves_its_socket_through_the_acceptor(
        queued: tuple[socket.socket, list[socket.socket]]) -> None:
    sock, pool = queued
    config = uvicorn.Config(_hello, lifespan="off", loop="none", log_level="warning")
    config.load()
    server = DrainingServer(config, app=None, drain_s=1.0)  # type: ignore[arg-type]
    server.lifespan = config.lifespan_class(config)

    async def main() -> int:
        await server.startup([sock])
        try:
            assert [type(s) for s in server.servers] == [Acceptor]
            turns = await _Turns(lambda: len(server.server_state.connections) == WAITING).wait()
            pool[-1].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await asyncio.to_thread(pool[-1].recv, 4096)
            assert answer.startswith(b"HTTP/1.1 200") and b"hello" in answer, answer
        finally:
            server.should_exit = server.force_exit = True
            await server.shutdown([sock])
        return turns

    turns = _run(main)
    assert turns <= 4, f"{turns} turns to take {WAITING} waiting connections"
    assert sock.fileno() == -1  # closed at shutdown, as uvicorn closes the sockets it serves


class _Failing:
    """A listening socket whose next accepts fail with `errors`, in turn."""

    def __init__(self, sock: socket.socket, errors: list[OSError]) -> None:
        self.sock, self.errors, self.failed = sock, errors, 0

    def accept(self) -> tuple[socket.socket, Any]:
        if self.errors:
            self.failed += 1
            raise self.errors.pop(0)
        return self.sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.mark.parametrize("error", [
    ConnectionAbortedError(errno.ECONNABORTED, "a client left while it waited"),
    OSError(errno.EPROTO, "a protocol error on the waiting connection"),
    OSError(errno.EHOSTUNREACH, "the waiting connection's host is unreachable"),
    OSError(errno.EMFILE, "out of file descriptors"),
])
def test_a_failed_accept_loses_no_other_connection(
    error: OSError, queued: tuple[socket.socket, list[socket.socket]],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(acceptor_module, "PAUSE_S", 0.01)
    sock, clients = queued
    made: list[asyncio.BaseTransport] = []
    failing = _Failing(sock, [error])

    async def main() -> int:
        all_made = asyncio.Event()

        def told() -> None:
            if len(made) == len(clients):
                all_made.set()

        acceptor = Acceptor(failing, lambda: _Counted(made, told))  # type: ignore[arg-type]
        await asyncio.wait_for(all_made.wait(), 10)
        acceptor.close()
        _close(made)
        return 0

    with caplog.at_level(logging.WARNING, "batchserve.api"):
        _run(main)
    assert failing.failed == 1 and len(made) == len(clients)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    paused = [r.getMessage() for r in caplog.records if "paused" in r.getMessage()]
    assert len(paused) == (1 if error.errno == errno.EMFILE else 0), paused


class _Reset:
    """An accepted connection the client reset before it was handed over."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.closed = conn, False

    def setsockopt(self, *args: Any) -> None:
        raise ConnectionResetError(errno.ECONNRESET, "reset by the client")

    def close(self) -> None:
        self.closed = True
        self.conn.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def test_a_connection_reset_before_it_is_served_is_closed_and_the_rest_are_made(
    queued: tuple[socket.socket, list[socket.socket]], caplog: pytest.LogCaptureFixture,
) -> None:
    sock, clients = queued
    made: list[asyncio.BaseTransport] = []
    reset: list[_Reset] = []

    class First(_Failing):
        def accept(self) -> tuple[socket.socket, Any]:
            conn, address = self.sock.accept()
            if not reset:
                reset.append(_Reset(conn))
                return reset[0], address  # type: ignore[return-value]
            return conn, address

    async def main() -> int:
        acceptor = Acceptor(First(sock, []), lambda: _Counted(made))  # type: ignore[arg-type]
        turns = await _Turns(lambda: len(made) == len(clients) - 1).wait()
        acceptor.close()
        _close(made)
        return turns

    turns = _run(main)
    assert reset[0].closed and len(made) == len(clients) - 1 and turns <= 4
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
