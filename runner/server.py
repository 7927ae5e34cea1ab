"""A runner process: one model, one dispatcher, listening for framed calls.

Start one by itself with `batchserve runner --config configuration.yml --runner NAME --listen
tcp:0.0.0.0:7000` (or `python -m batchserve.runner`, or a unix socket address); it speaks HTTP
only for its own metrics and health (`--metrics-port`, see `batchserve.runner.status`). Every
connection opens with the handshake of `batchserve.runner.core.handshake` before any call; the
runner listens once the model is loaded and calibrated, so an answered ping means ready.
SIGTERM or SIGINT stops accepting, lets queued and running batches finish for
`timeouts.drain_s`, refuses what is left and exits 0, without waiting for a model call that
is still running then (a thread cannot be stopped, and the process must not outlive its grace
period).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import ipaddress
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from . import models
from .core.config import Config, ConfigError, RunnerConfig, load
from .core.handshake import Refused, admit, opening
from .core.security import Credentials, credentials
from .core.signature import Signature, SignatureError
from .core.timeouts import Timeouts
from .core.types import Tensors
from .core.wire import (
    Address,
    Backlog,
    Call,
    Failure,
    FailureCode,
    FrameReader,
    Hello,
    Outbox,
    Ping,
    Pong,
    Result,
    Results,
    Started,
    Welcome,
    WireError,
    batched,
    decode,
    encode,
    tune,
)
from .dispatcher import Dispatcher, Rejection
from .metrics import RunnerMetrics
from .policy.policies import build_policy
from .status import StatusServer, status_server

log = logging.getLogger("runner")
DEFAULT_TIMEOUTS = Timeouts()


class Connection(asyncio.BufferedProtocol):
    """One client connection; calls are multiplexed on it by id and answered in any order,
    once the client has passed the handshake."""

    def __init__(self, runner: RunnerConfig, dispatcher: Dispatcher, live: set[Connection],
                 token: bytes | None = None, timeouts: Timeouts = DEFAULT_TIMEOUTS,
                 signature: Signature | None = None) -> None:
        self.runner = runner
        self.signature = signature or Signature(runner)
        self.dispatcher = dispatcher
        self.live = live
        self.token = token
        self.timeouts = timeouts
        self.reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self.outbox: Outbox | None = None
        self.greeting: Hello | None = None  # this runner's Hello, until the client's passes
        self.heard = time.monotonic()
        self._overdue: asyncio.TimerHandle | None = None
        self._starting: list[int] = []
        self._answers: list[Result] = []  # this turn's, written as one frame at its end
        self._publish = False  # publish the backlog with the next write
        self.calls = False  # it has sent calls: an API worker, which the backlog is for
        self.local = True  # the API worker runs on this machine: its CPU and clock are ours

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.outbox = Outbox(self.transport, self._last_words)  # type: ignore[arg-type]
        self.live.add(self)
        self.local = _local(transport.get_extra_info("peername"))
        tune(transport, self.timeouts.link_idle_s)
        self.greeting = opening(self.runner.name, self.runner.batching.max_batch_size)
        self.transport.writelines(encode(self.greeting))  # type: ignore[union-attr]
        self._overdue = asyncio.get_running_loop().call_later(
            self.timeouts.hello_timeout_s, self._hello_overdue)

    def connection_lost(self, exc: Exception | None) -> None:
        # The outbox holds a method of this connection: drop the cycle now, or each closed
        # connection's buffers wait for a full collection, which an idle runner rarely runs.
        self.transport = self.outbox = None
        self.live.discard(self)
        if self._overdue is not None:
            self._overdue.cancel()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.heard = time.monotonic()
        dispatcher = self.dispatcher
        dispatcher.metrics.reads.inc()
        dispatcher.gather()
        try:
            for body in self.reader.buffer_updated(nbytes):
                if self.transport is None or self.transport.is_closing():
                    return
                self._handle(decode(body))
        except WireError as exc:
            log.warning("runner %s: closing a connection: %s", self.runner.name, exc)
            if self.transport is not None:
                self.transport.close()
        finally:
            dispatcher.gathered()
        # Only a connection from this machine is held: its calls carry when they were sent
        # on our clock, so one read late keeps its deadline. Never in the middle of a frame:
        # a large call (an image of 600 KB) outgrows the socket's buffer, and held there it
        # would cross one buffer a batch, arriving batches late with its deadline running.
        if (self.local and self.transport is not None and self.greeting is None
                and not self.reader.partial and dispatcher.hold(self)):
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    @property
    def partial(self) -> bool:
        """A call is coming in (never on a connection that has closed)."""
        return self.transport is not None and not self.transport.is_closing() \
            and self.reader.partial

    def close(self, why: str) -> None:
        """Log why, and drop this connection."""
        log.warning("runner %s: closing the connection from %s: %s",
                    self.runner.name, self._peer(), why)
        if self.transport is not None:
            self.transport.close()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        if isinstance(peer, tuple):
            return f"{peer[0]}:{peer[1]}"
        return "a local process"

    def _handle(self, message: object) -> None:
        if self.greeting is not None:
            self._admit(message)
        elif isinstance(message, Call):
            self.calls = True
            try:
                self.signature.check(message.tensors, message.rows)
            except SignatureError as exc:
                self._send(Failure(message.id, FailureCode.INVALID, str(exc)))
                return
            reply = functools.partial(self._reply, message.id)
            started = functools.partial(self._started, message.id)
            self.dispatcher.submit(message.tensors, message.rows, message.budget_s, reply, started,
                                   message.group, message.spent_s,
                                   message.front_s if self.local else 0.0, self._sent(message))
        elif isinstance(message, Ping):
            self._send(Pong(message.id))
        else:
            raise WireError(f"a runner does not accept {type(message).__name__} frames")

    def _sent(self, call: Call) -> float | None:
        """When `call` was sent, if that is on our clock (from this machine): a call read
        late, after the batch its connection was held for, keeps its deadline."""
        return call.sent_s if self.local and call.sent_s > 0.0 else None

    def _admit(self, message: object) -> None:
        assert self.greeting is not None and self.transport is not None
        try:
            welcome = admit(self.greeting, message, self.token)  # type: ignore[arg-type]
        except Refused as exc:
            self._refuse(str(exc))
            return
        self.greeting = None
        if self._overdue is not None:
            self._overdue.cancel()
        self._send(welcome)

    def _refuse(self, why: str) -> None:
        """Tell the client why (it logs it), then close: it sent no call yet."""
        log.warning("runner %s: refused a connection from %s: %s",
                    self.runner.name, self._peer(), why)
        if self.transport is not None:
            self.transport.writelines(encode(Failure(0, FailureCode.HANDSHAKE, why)))
            self.transport.close()

    def _hello_overdue(self) -> None:
        if self.greeting is not None and self.transport is not None:
            self._refuse(f"no Hello within {self.timeouts.hello_timeout_s:g} s")

    def _reply(self, ident: int, result: Tensors | Rejection, spare_s: float) -> None:
        if isinstance(result, Rejection):
            self._send(Failure(ident, result.code, result.message, result.retry_after_s,
                               result.predicted_s, result.deadline_s, result.rows_ahead))
        elif self.transport is not None and self.outbox is not None:
            self._answers.append(Result(ident, result, spare_s))
            self._publish = True
            self.outbox.wake()

    def _started(self, ident: int) -> None:
        """Gather the calls a batch starts into one Started frame, written with whatever
        else this turn writes (the answers of the batch before)."""
        self._starting.append(ident)
        if self.outbox is not None:
            self.outbox.wake()

    def publish(self) -> None:
        """Send the backlog at the end of this turn: a batch started, so arrivals now wait
        for it, and the API worker should know before it sends what this runner would
        refuse (what it sends is read only once the batch ends)."""
        if self.outbox is not None and self.calls:
            self._publish = True
            self.outbox.wake()

    def _last_words(self) -> list[Result | Results | Started | Backlog]:
        """What goes last in each write: this turn's answers, in one frame where they line up
        (a batch's, `batched`), the calls whose batch started, and with answers or a batch's
        start, the backlog (`Dispatcher.admission`), so the API worker refuses in place."""
        words: list[Result | Results | Started | Backlog] = []
        if self._answers:
            words += batched(self._answers, self.runner.batch_dim[1])
            self._answers = []
        if self._starting:
            words.append(Started(tuple(self._starting)))
            self._starting = []
        if self._publish:
            self._publish = False
            admission = self.dispatcher.admission()
            words.append(Backlog(admission.wait_s, admission.rows_ahead, admission.drain_s,
                                 admission.row_s, admission.request_rows, admission.next_rows))
        return words

    def _send(self, message: Failure | Pong | Welcome) -> None:
        if self.transport is not None and self.outbox is not None:
            if isinstance(message, Failure):
                self._publish = True
            self.outbox.put(message)


def _local(peer: object) -> bool:
    """Whether a connection comes from this machine (a unix socket or a loopback address)."""
    if not isinstance(peer, tuple):
        return True
    try:
        return ipaddress.ip_address(peer[0]).is_loopback
    except ValueError:
        return False


async def serve(config: Config, runner: RunnerConfig, address: Address,
                keys: Credentials | None = None, metrics_port: int | None = None) -> bool:
    """Load, calibrate, listen until SIGTERM/SIGINT, then drain; whether a model call is
    still running after the drain. `metrics_port` adds this process's own HTTP endpoints."""
    keys = keys or Credentials()
    keys.check(address)
    tls = keys.server_context(address)
    # Counted before the model loads, so a runner that dies loading still shows a restart loop.
    metrics = RunnerMetrics(runner.name, runner.batching.max_latency_ms / 1000,
                            runner.max_cost, runner.workers)
    model = models.load(config, runner)
    live: set[Connection] = set()
    dispatcher = Dispatcher(runner, model, build_policy(runner), metrics,
                            launched=lambda: _publish(live))
    await dispatcher.start()
    if address.scheme == "unix":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address.target)
    timeouts = config.timeouts
    signature = Signature(runner)
    # What start-up built (the model, its libraries) lives as long as the process: the
    # collector need not walk it again at every full collection.
    gc.freeze()
    server = await address.serve(
        lambda: Connection(runner, dispatcher, live, keys.token, timeouts, signature), tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sweeper = asyncio.create_task(_drop_silent(live, timeouts))
    status = await _start_status(address, metrics_port, lambda: not stop.is_set())
    guards = [name for name, on in (("token", keys.token), ("TLS", tls)) if on]
    log.info("runner %s pid %d ready on %s (%s)", runner.name, os.getpid(),
             _bound(server, address), ", ".join(guards) or "no token")
    await stop.wait()
    log.info("runner %s pid %d stopping: draining for up to %g s",
             runner.name, os.getpid(), config.timeouts.drain_s)
    server.close()
    sweeper.cancel()
    await dispatcher.drain(config.timeouts.drain_s)
    await asyncio.sleep(0)  # let the last replies reach their transports
    for connection in list(live):
        if connection.transport is not None:
            connection.transport.close()
    if address.scheme == "unix":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address.target)
    if status is not None:
        status[0].should_exit = True
        await status[1]
    metrics.close()
    return dispatcher.busy


def _publish(live: set[Connection]) -> None:
    for connection in live:
        connection.publish()


def _bound(server: asyncio.Server, address: Address) -> Address:
    """The address as bound: with TCP port 0, the port the system chose."""
    if address.scheme != "tcp" or not server.sockets:
        return address
    port = server.sockets[0].getsockname()[1]
    return Address("tcp", f"{address.host}:{port}")


async def _drop_silent(live: set[Connection], timeouts: Timeouts) -> None:
    """Close connections nothing has come from for `ping_misses + 1` idle periods: a client
    pings after one, so its host or the network between has gone."""
    limit = timeouts.link_idle_s * (timeouts.ping_misses + 1)
    while True:
        await asyncio.sleep(timeouts.link_idle_s)
        now = time.monotonic()
        for connection in list(live):
            if now - connection.heard > limit:
                connection.close(f"nothing heard for {limit:g} s")


async def _start_status(
    address: Address, port: int | None, ready: Callable[[], bool]
) -> tuple[StatusServer, asyncio.Task[None]] | None:
    """Serve the runner's own HTTP endpoints when `port` is given, on the host it listens on."""
    if port is None:
        return None
    host = address.host if address.scheme == "tcp" else "127.0.0.1"
    server = status_server(host, port, ready)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise ValueError(f"cannot serve metrics and health on {host}:{port}")
        await asyncio.sleep(Timeouts.STATUS_POLL_S)
    log.info("runner metrics and health on http://%s:%d", host, server.port)
    return server, task


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="batchserve runner", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", default="configuration.yml", help="configuration file")
    parser.add_argument("--runner", required=True, help="the runner name to serve")
    parser.add_argument("--listen", "--address", dest="address",
                        help="where to listen: tcp:host:port or unix:/path.sock")
    parser.add_argument("--socket", help="shorthand for --listen unix:PATH")
    parser.add_argument("--metrics-port", type=int,
                        help="serve /metrics, /health/live and /health/ready on this port "
                             "(0: any free one), on the --listen host")
    args = parser.parse_args(argv)
    if (args.address is None) == (args.socket is None):
        parser.error("give exactly one of --listen or --socket")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = load(args.config)
        runner = config.runners.get(args.runner)
        if runner is None:
            raise ConfigError(f"runners.{args.runner} is not in {args.config}")
        address = Address.parse(args.address or f"unix:{args.socket}")
        if address.discovered:
            raise ConfigError(f"--listen {address}: a runner listens on tcp:host:port or "
                              "unix:/path (dns+tcp: is for finding runners)")
        keys = credentials(config)
        keys.check(address)
        os.environ.setdefault("OMP_NUM_THREADS", str(runner.threads))
        running = serve(config, runner, address, keys, args.metrics_port)
        try:
            import uvloop
        except ImportError:
            stuck = asyncio.run(running)
        else:
            stuck = uvloop.run(running)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if stuck:  # the interpreter would wait for the model thread at exit, maybe for ever
        log.warning("runner %s pid %d: a model call is still running after the drain; "
                    "exiting without it", args.runner, os.getpid())
        logging.shutdown()
        os._exit(0)
    return 0
