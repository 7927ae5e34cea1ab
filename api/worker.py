"""One API worker process: uvicorn serving the app on a socket of its own, on the server's port.

Every worker listens on the server's port on a socket of its own, bound with `SO_REUSEPORT`
beside the others' (the supervisor holds the port, `batchserve.api.ports`), so the kernel
spreads connections over the workers and a worker can be replaced alone. It accepts them
itself, every one waiting at each wake (`batchserve.api.http.acceptor`), not one a turn of its
event loop as uvloop's server does.

Inference requests are answered by `batchserve.api.http.connection`, uvicorn's HTTP protocol with
the inference route taken off its ASGI path; the worker's main loop sleeps until a signal
comes, where uvicorn's wakes ten times a second.

A stop signal does not close the socket at once, as uvicorn would: the worker goes on
accepting and answers every new request 503 (`draining`) while the requests it holds finish,
so a client is told to go elsewhere instead of waiting in a queue nobody reads. When they are
answered, or `timeouts.drain_s` has passed, uvicorn's own shutdown runs in what remains of
that grace period, and the worker exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import socket
import time
from collections.abc import Sequence
from types import FrameType

import orjson
import uvicorn

from ..runner.core.config import load
from ..runner.core.security import credentials
from ..runner.core.timeouts import Timeouts
from ..runner.core.wire import Address
from . import ports
from .grpc.server import GrpcServer
from .http.acceptor import Acceptor
from .http.app import App, create_app
from .http.connection import protocol_for

log = logging.getLogger("batchserve.api")


class DrainingServer(uvicorn.Server):
    """uvicorn that drains its app before it stops accepting (see the module docstring)."""

    def __init__(
        self, config: uvicorn.Config, app: App, drain_s: float, ready_fd: int | None = None,
        grpc: GrpcServer | None = None,
    ) -> None:
        super().__init__(config)
        self.app = app
        self.grpc = grpc
        self.drain_s = drain_s
        self.ready_fd = ready_fd
        self.deadline: float | None = None
        self.signalled: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.signalled = asyncio.Event()
        await super().startup([])  # the lifespan, and no server: the sockets are ours
        # Each connection made as uvicorn's startup makes it for the servers it creates.
        protocol = functools.partial(
            self.config.http_protocol_class,  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state)
        self.servers += [Acceptor(sock, protocol) for sock in sockets or ()]  # type: ignore[misc]
        if self.grpc is not None and not self.should_exit:
            await self.grpc.start()
        gc.freeze()  # start-up's objects live as long as the worker: out of the collector's way
        # Serving, and a stop signal now drains: until here it killed the process (exit -15),
        # so the supervisor is ready only once every worker has said so.
        if self.ready_fd is not None:
            os.write(self.ready_fd, b"1")
            os.close(self.ready_fd)
            self.ready_fd = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Only note it, like uvicorn, but never re-raise it after the shutdown: a drained
        # worker exits 0, not killed by its own signal.
        if self.deadline is None:
            self.deadline = time.monotonic() + self.drain_s
            self.app.service.stop()
            if self.grpc is not None and self.loop is not None:
                # gRPC's own drain: GOAWAY now, the calls it holds finish within the grace.
                self.loop.call_soon_threadsafe(self.grpc.stop, self.drain_s)
        else:
            self.should_exit = self.force_exit = True
        if self.loop is not None and self.signalled is not None:
            self.loop.call_soon_threadsafe(self.signalled.set)

    async def main_loop(self) -> None:
        """Sleep until a signal (uvicorn's loop ticks every 100 ms), then tick until the
        drain is done."""
        assert self.signalled is not None
        if self.deadline is None and not self.should_exit:
            await self.signalled.wait()
        while not await self.on_tick(0):  # noqa: ASYNC110 - a deadline, polled while draining
            await asyncio.sleep(Timeouts.DRAIN_TICK_S)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.grpc is not None:
            self.grpc.stop(0)  # a forced exit; else stopped at the signal, and done by now
            await self.grpc.wait_stopped()
        await super().shutdown(sockets)

    async def on_tick(self, counter: int) -> bool:
        if self.deadline is not None and not self.should_exit:
            left = self.deadline - time.monotonic()
            if self.app.service.idle or left <= 0:
                self._finish(left)
        return await super().on_tick(counter)

    def _finish(self, left: float) -> None:
        service = self.app.service
        if not service.idle:
            log.warning("api worker pid %d: %d request(s) unanswered after %g s; answering 503",
                        os.getpid(), service.inflight, self.drain_s)
            service.abandon()
        # uvicorn's graceful wait is the rest of this grace period, not another one.
        self.config.timeout_graceful_shutdown = max(left, Timeouts.FLUSH_S)  # type: ignore[assignment]
        self.should_exit = True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchserve.api.worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--runners", required=True, help='JSON {"runner": ["unix:/a.sock"]}')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="the port the supervisor holds")
    parser.add_argument("--ready-fd", type=int, help="a pipe to write one byte to once serving")
    parser.add_argument("--grpc-host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=0, help="0: no gRPC")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = load(args.config)
    addresses = {
        name: [Address.parse(text) for text in texts]
        for name, texts in orjson.loads(args.runners).items()
    }
    keys = credentials(config)
    for address in (a for texts in addresses.values() for a in texts):
        keys.check(address)
    app = create_app(config, addresses, keys)
    listener = ports.listen(args.host, args.port)
    timeouts = config.timeouts
    server = DrainingServer(uvicorn.Config(
        app,
        loop="uvloop",
        http=protocol_for(app.service),
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=timeouts.keep_alive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=timeouts.drain_s,  # type: ignore[arg-type]
        proxy_headers=False,
    ), app, timeouts.drain_s, args.ready_fd,
        GrpcServer(app.service, args.grpc_host, args.grpc_port) if args.grpc_port else None)
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
