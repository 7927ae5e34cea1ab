"""A runner process: one model, one dispatcher, listening for framed calls.

Start one by itself with `python -m batchserve.runner --config configuration.yml --runner NAME
--address unix:/tmp/NAME.sock`; it knows nothing of HTTP. It answers pings once the model
is loaded and calibrated, which is how a supervisor knows it is ready. SIGTERM or SIGINT
stops accepting, lets queued and running batches finish for `timeouts.drain_s`, refuses what
is left and exits 0, without waiting for a model call that is still running then (a thread
cannot be stopped, and the process must not outlive its grace period).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Sequence

from batchserve.runner import models
from batchserve.runner.config import Config, ConfigError, RunnerConfig, load
from batchserve.runner.dispatcher import Dispatcher, Rejection
from batchserve.runner.metrics import RunnerMetrics
from batchserve.runner.policies import make_policy
from batchserve.runner.policy import Policy
from batchserve.runner.types import Tensors
from batchserve.runner.wire import (
    Address,
    Call,
    Failure,
    FailureCode,
    FrameReader,
    Outbox,
    Ping,
    Pong,
    Result,
    Started,
    WireError,
    decode,
)

log = logging.getLogger("runner")


def check_inputs(runner: RunnerConfig, tensors: Tensors) -> str | None:
    """Why `tensors` do not fit the runner's signature, or None when they do."""
    expected = {spec.name for spec in runner.inputs}
    if set(tensors) != expected:
        return f"inputs {sorted(tensors)} do not match the signature's {sorted(expected)}"
    dim = runner.batch_dim[0]
    batch = {array.shape[dim] if array.ndim > dim else -1 for array in tensors.values()}
    for spec in runner.inputs:
        array = tensors[spec.name]
        if array.dtype != spec.dtype:
            return f"input {spec.name!r} has dtype {array.dtype}; expected {spec.datatype}"
        fits = array.ndim == len(spec.shape) and all(
            want in (-1, got) for want, got in zip(spec.shape, array.shape, strict=True)
        )
        if not fits:
            return f"input {spec.name!r} has shape {list(array.shape)}; expected {list(spec.shape)}"
    if len(batch) != 1 or min(batch) < 1:
        return f"inputs must share one batch size of at least 1 on dimension {dim}"
    return None


class Connection(asyncio.BufferedProtocol):
    """One client connection; calls are multiplexed on it by id and answered in any order."""

    def __init__(self, runner: RunnerConfig, dispatcher: Dispatcher, live: set[Connection]):
        self.runner = runner
        self.dispatcher = dispatcher
        self.live = live
        self.reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self.outbox: Outbox | None = None
        self._starting: list[int] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.outbox = Outbox(self.transport)  # type: ignore[arg-type]
        self.live.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.live.discard(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            for body in self.reader.buffer_updated(nbytes):
                self._handle(decode(body))
        except WireError as exc:
            log.warning("runner %s: closing a connection: %s", self.runner.name, exc)
            if self.transport is not None:
                self.transport.close()

    def _handle(self, message: object) -> None:
        if isinstance(message, Call):
            problem = check_inputs(self.runner, message.tensors)
            if problem is not None:
                self._send(Failure(message.id, FailureCode.INVALID, problem))
                return
            reply = functools.partial(self._reply, message.id)
            started = functools.partial(self._started, message.id)
            self.dispatcher.submit(message.tensors, message.budget_s, reply, started)
        elif isinstance(message, Ping):
            self._send(Pong(message.id))
        else:
            raise WireError(f"a runner does not accept {type(message).__name__} frames")

    def _reply(self, ident: int, result: Tensors | Rejection) -> None:
        if isinstance(result, Rejection):
            self._send(Failure(ident, result.code, result.message, result.retry_after_s))
        else:
            self._send(Result(ident, result))

    def _started(self, ident: int) -> None:
        """Gather the calls a batch starts into one Started frame, sent after this turn."""
        if not self._starting:
            asyncio.get_running_loop().call_soon(self._send_started)
        self._starting.append(ident)

    def _send_started(self) -> None:
        calls, self._starting = self._starting, []
        self._send(Started(tuple(calls)))

    def _send(self, message: Result | Failure | Started | Pong) -> None:
        if self.transport is not None and self.outbox is not None:
            self.outbox.put(message)


def build_policy(runner: RunnerConfig) -> Policy:
    """The adaptive policy when batching is on; one request at a time when it is off."""
    batching = runner.batching
    latency_s = batching.max_latency_ms / 1000
    if not batching.enabled:
        return make_policy("none", runner.max_cost, latency_s)
    if runner.layout == "rows":
        return make_policy("adaptive", batching.max_batch_size, latency_s)
    # Sized in elements, capped in elements and, by max_batch_size, in requests.
    return make_policy(
        "adaptive", runner.max_cost, latency_s, max_requests=batching.max_batch_size
    )


async def serve(config: Config, runner: RunnerConfig, address: Address) -> bool:
    """Load, calibrate, listen until SIGTERM/SIGINT, then drain; whether a model call is
    still running after the drain."""
    # Counted before the model loads, so a runner that dies loading still shows a restart loop.
    metrics = RunnerMetrics(runner.name, runner.batching.max_latency_ms / 1000)
    model = models.load(config, runner)
    dispatcher = Dispatcher(runner, model, build_policy(runner), metrics)
    await dispatcher.start()
    if address.scheme == "unix":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address.target)
    live: set[Connection] = set()
    server = await address.serve(lambda: Connection(runner, dispatcher, live))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info("runner %s pid %d ready on %s", runner.name, os.getpid(), address)
    await stop.wait()
    log.info("runner %s pid %d stopping: draining for up to %g s",
             runner.name, os.getpid(), config.timeouts.drain_s)
    server.close()
    await dispatcher.drain(config.timeouts.drain_s)
    await asyncio.sleep(0)  # let the last replies reach their transports
    for connection in list(live):
        if connection.transport is not None:
            connection.transport.close()
    if address.scheme == "unix":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address.target)
    metrics.close()
    return dispatcher.busy


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m batchserve.runner", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", default="configuration.yml", help="configuration file")
    parser.add_argument("--runner", required=True, help="the runner name to serve")
    parser.add_argument("--address", help="unix:/path.sock or tcp:host:port")
    parser.add_argument("--socket", help="shorthand for --address unix:PATH")
    args = parser.parse_args(argv)
    if (args.address is None) == (args.socket is None):
        parser.error("give exactly one of --address or --socket")
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
        os.environ.setdefault("OMP_NUM_THREADS", str(runner.threads))
        try:
            import uvloop
        except ImportError:
            stuck = asyncio.run(serve(config, runner, address))
        else:
            stuck = uvloop.run(serve(config, runner, address))
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if stuck:  # the interpreter would wait for the model thread at exit, maybe for ever
        log.warning("runner %s pid %d: a model call is still running after the drain; "
                    "exiting without it", args.runner, os.getpid())
        logging.shutdown()
        os._exit(0)
    return 0
