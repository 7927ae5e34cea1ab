"""Taking new connections off a worker's listening socket: every one waiting, at each wake.

uvloop's servers accept through libuv, which takes one connection per turn of the event loop
(and leaves the rest to the next turn's poll). Idle, a turn is microseconds; under load it is
the time the loop takes to serve what is ready, some 10 to 20 ms, so a worker accepts only
50 to 100 connections a second. A client that opens its pool at once, or reconnects after a
restart, finds hundreds of connections queued unaccepted: measured here, 1,024 connections
opened within half a second at 4,800 req/s left 700 in the queue and their first requests
waiting 1 to 2 s before the worker read them, a wait no deadline or shedder could see.

`Acceptor` watches the socket itself and accepts every connection waiting (up to `BURST`)
at each wake, handing each to the loop as uvicorn's own server would
(`connect_accepted_socket`), so a burst of connections costs one turn. It stands in uvicorn's
list of servers, which closes it when the worker shuts down.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("batchserve.api")

BURST = 512
"""The most connections accepted at one wake: the rest wait one turn, so requests on the
connections already open are read in between."""
PAUSE_S = 1.0
"""How long accepting pauses when the process is out of file descriptors."""
OUT_OF_FILES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
CONNECTION_GONE = frozenset(getattr(errno, name) for name in (
    "ECONNABORTED", "EPROTO", "ENOPROTOOPT", "ENETDOWN", "ENETUNREACH", "EHOSTDOWN",
    "EHOSTUNREACH", "ENONET", "EOPNOTSUPP") if hasattr(errno, name))
"""What Linux's accept(2) reports of the waiting connection itself (a client that left, a
network error its handshake met), which it asks to be taken as EAGAIN for that connection:
the next one may be fine."""


class Acceptor:
    """A listening socket served by `protocol`, accepted in bursts (see the module doc).

    It has what uvicorn calls on its servers at shutdown: `close` and `wait_closed`."""

    def __init__(self, sock: socket.socket, protocol: Callable[[], asyncio.Protocol]) -> None:
        self.sock = sock
        self.protocol = protocol
        self.loop = asyncio.get_running_loop()
        self.opening: set[asyncio.Task[object]] = set()  # connections being handed over
        self.closed = False
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self.accept)

    def accept(self) -> None:
        """Accept what waits, up to `BURST`."""
        for _ in range(BURST):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in CONNECTION_GONE:
                    log.debug("a waiting connection failed before it was accepted: %s", exc)
                    continue
                if exc.errno in OUT_OF_FILES:  # the queue keeps them meanwhile
                    log.warning("accepting connections paused for %g s: %s", PAUSE_S, exc)
                    self.loop.remove_reader(self.sock.fileno())
                    self.loop.call_later(PAUSE_S, self._resume)
                else:
                    log.error("accepting a connection failed: %s", exc)
                return
            task = self.loop.create_task(self._serve(conn))
            self.opening.add(task)
            task.add_done_callback(self.opening.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await self.loop.connect_accepted_socket(self.protocol, conn)
        except OSError as exc:  # the client left or reset before it was served
            log.debug("an accepted connection failed: %s", exc)
            conn.close()
        except Exception:
            log.exception("serving an accepted connection failed")
            conn.close()

    def _resume(self) -> None:
        if not self.closed:
            self.loop.add_reader(self.sock.fileno(), self.accept)

    def close(self) -> None:
        """Accept no more; the socket itself is its owner's to close."""
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())

    async def wait_closed(self) -> None:
        """Once the connections being handed over are open (they are then uvicorn's)."""
        if self.opening:
            await asyncio.wait(self.opening)
