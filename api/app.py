"""The HTTP front: Open Inference Protocol v2 routes over the runner pools.

Each request is decoded and checked against the runner's signature here, so a runner only ever sees
tensors that fit; its deadline starts when the whole request has arrived, and whatever time is left
is what the runner is given. Errors of every kind leave through `error_response`. Every answer is
counted once in `batchserve_requests_total` by status, and every 503 once more in
`batchserve_unavailable_total` by its reason (see `batchserve.api.errors`); the worker's in-flight
counts and connected runner processes are republished every `PUBLISH_S`.

Draining (`Service.stop`, called by the worker on SIGTERM): readiness turns 503 at once, new
inference requests are answered 503 (`stopping`) before any work, and the requests already
accepted go on until they are answered (`Service.idle`) or the grace period ends, when those
still waiting on a runner are answered 503 (`Service.abandon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..runner.core.config import Config, RunnerConfig
from ..runner.core.security import Credentials
from ..runner.core.types import Tensors
from ..runner.core.wire import Address, FailureCode
from ..runner.metrics import SECONDS_BUCKETS, registry
from . import openapi, protocol
from .dispatch import NO_KEYS, Pool, RunnerFailure
from .errors import (
    BadRequest,
    BatchserveError,
    ModelNotFound,
    ModelTimeout,
    Overloaded,
    PayloadTooLarge,
    RunnerUnavailable,
    SloRefused,
    Stopping,
    TooManyRows,
    Unavailable,
    error_response,
)
from .overload import LAG_FLOOR_S, Shedder, watch
from .reserve import Reserve

log = logging.getLogger(__name__)
VERSION = "1"

request_duration = Histogram(
    "batchserve_request_duration_seconds", "Inference requests from arrival to answer",
    ["runner", "code"], buckets=SECONDS_BUCKETS,
)
requests_total = Counter(
    "batchserve_requests_total", "Inference requests answered", ["runner", "code"]
)
loop_lag = Histogram(
    "batchserve_api_loop_lag_seconds",
    "How late each API worker's event loop ran a timer due every 10 ms: what a request waits "
    "in a worker before any of its code sees it",
    buckets=SECONDS_BUCKETS,
)
UNAVAILABLE_REASONS = ("refused", "expired", "stopping", "shed", "unreachable", "late")
unavailable_total = Counter(
    "batchserve_unavailable_total", "Inference requests answered 503, by why", ["runner", "reason"]
)
inflight_requests = Gauge(
    "batchserve_inflight_requests", "Requests an API worker has sent to a runner, unanswered",
    ["runner"], multiprocess_mode="liveall",
)
processes_connected = Gauge(
    "batchserve_runner_processes_connected", "Runner processes an API worker is connected to",
    ["runner"], multiprocess_mode="liveall",
)
processes_configured = Gauge(
    "batchserve_runner_processes_configured", "Runner processes the configuration asks for",
    ["runner"], multiprocess_mode="liveall",
)
PUBLISH_S = 1.0


def _failure_error(runner: str, failure: RunnerFailure) -> BatchserveError:
    """What a runner's failure code means to an HTTP client."""
    detail = failure.failure
    retry = max(detail.retry_after_s, 1.0)
    if detail.code == FailureCode.INVALID:
        return BadRequest(detail.message)
    if detail.code == FailureCode.REFUSED:
        return SloRefused(runner, retry)
    if detail.code == FailureCode.EXPIRED:
        return Unavailable(detail.message, retry, "expired")
    if detail.code == FailureCode.STOPPING:
        return RunnerUnavailable(runner, retry)
    if detail.code == FailureCode.TIMEOUT:
        return ModelTimeout(detail.message)
    if detail.code == FailureCode.TOO_LARGE:
        return TooManyRows(detail.message)
    return BatchserveError(detail.message)


def _raw_headers(headers: Mapping[str, str], length: int) -> list[tuple[bytes, bytes]]:
    raw = [(name.lower().encode("latin-1"), value.encode("latin-1"))
           for name, value in headers.items()]
    raw.append((b"content-length", b"%d" % length))
    return raw


class Service:
    """The configuration and one pool per runner, with the inference path over them.

    Inference is a plain ASGI handler, not a Starlette route: it is the one path every
    request takes, and it skips the routing and middleware layers it does not need.
    """

    def __init__(self, config: Config, addresses: Mapping[str, Sequence[Address]],
                 keys: Credentials = NO_KEYS) -> None:
        self.config = config
        self.pools = {
            name: Pool(name, addresses.get(name, ()), config.timeouts, keys,
                       choice=runner.choice)
            for name, runner in config.runners.items()
        }
        # The loop serves every runner, so it must keep up with the tightest limit.
        tightest_s = min(r.batching.max_latency_ms for r in config.runners.values()) / 1000
        self.shedder = Shedder(target_s=max(LAG_FLOOR_S, tightest_s / 10))
        self.inflight = 0  # requests accepted and not yet answered
        self.stopping = False
        self.waiting = dict.fromkeys(config.runners, 0)  # calls out to each runner
        self.reserves = {name: Reserve() for name in config.runners}
        self._ok = {
            name: (request_duration.labels(name, "200"), requests_total.labels(name, "200"))
            for name in config.runners
        }
        # Every reason's series exists from the start, so a rate over it reads 0, not nothing.
        self._unavailable = {
            (name, reason): unavailable_total.labels(name, reason)
            for name in config.runners for reason in UNAVAILABLE_REASONS
        }

    def publish(self) -> None:
        """This worker's live gauges: calls in flight and runner processes connected."""
        for name, pool in self.pools.items():
            inflight_requests.labels(name).set(self.waiting[name])
            processes_connected.labels(name).set(sum(link.connected for link in pool.links))
            processes_configured.labels(name).set(len(pool.links))

    def stop(self) -> None:
        """Take no new work from now on: readiness and new inference requests answer 503."""
        self.stopping = True

    @property
    def idle(self) -> bool:
        """Whether every accepted request has been answered."""
        return self.inflight == 0

    def abandon(self) -> None:
        """The grace period is over: answer every request still waiting on a runner 503."""
        error = Stopping("the server stopped before the runner answered; retry shortly")
        for pool in self.pools.values():
            pool.abandon(error)

    def runner(self, name: str, version: str | None = None) -> RunnerConfig:
        runner = self.config.runners.get(name)
        if runner is None or version not in (None, VERSION):
            label = name if version is None else f"{name} version {version}"
            raise ModelNotFound(label, self.config.runners)
        return runner

    async def infer(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /v2/models/{name}[/versions/{version}]/infer."""
        started = time.monotonic()
        parts = scope["path"].split("/")
        name = parts[3]
        reason = ""
        try:
            runner = self.runner(name, parts[5] if len(parts) == 7 else None)
            if self.stopping:
                raise Stopping()
            self.inflight += 1
            try:
                self._shed()
                status, content, headers = 200, *await self._infer(scope, receive, runner)
            finally:
                self.inflight -= 1
        except Exception as exc:
            if not isinstance(exc, BatchserveError):
                log.exception("unexpected error answering a request", exc_info=exc)
            status, content, headers = error_response(exc)
            reason = getattr(exc, "reason", "")
        await send({"type": "http.response.start", "status": status,
                    "headers": _raw_headers(headers, len(content))})
        await send({"type": "http.response.body", "body": content})
        if name in self._ok:
            self._observe(name, status, started, reason)

    def _shed(self) -> None:
        """Refuse before any work when this worker is behind (see `batchserve.api.overload`)."""
        if self.inflight > self.config.api.max_inflight:
            raise Overloaded(f"{self.inflight - 1} requests in flight in this API worker")
        if not self.shedder.admits(random.random()):
            lag_ms = self.shedder.lag_s * 1000.0
            raise Overloaded(f"this API worker runs {lag_ms:.0f} ms behind")

    async def _infer(
        self, scope: Scope, receive: Receive, runner: RunnerConfig
    ) -> tuple[bytes, dict[str, str]]:
        length = header_length = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = value.decode("latin-1")
            elif key == b"inference-header-content-length":
                header_length = value.decode("latin-1")
        body = await self._body(receive, length)
        # The deadline runs from the whole request's arrival: its upload is the client's time.
        arrived = time.monotonic()
        call = protocol.decode_infer(body, protocol.parse_header_length(header_length), runner)
        limit = runner.batching.max_latency_ms / 1000
        if call.timeout_s is not None:
            limit = min(limit, call.timeout_s)
        reserve = self.reserves[runner.name]
        sent = time.monotonic()
        budget = limit - (sent - arrived) - reserve.seconds(limit)
        outputs = await self._call(runner.name, call.inputs, call.rows, budget, call.group)
        encoded = protocol.encode_infer(runner.name, call, outputs, runner)
        reserve.observe(time.monotonic() - (sent + budget))
        return encoded

    async def _body(self, receive: Receive, length: str | None) -> bytes:
        limit = self.config.api.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            raise PayloadTooLarge(limit, int(length))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(limit)
            if not message.get("more_body", False):
                return chunk if not chunks else b"".join([*chunks, chunk])
            chunks.append(chunk)

    async def _call(
        self, runner: str, inputs: Tensors, rows: int, budget: float, group: tuple[str, ...]
    ) -> Tensors:
        if budget <= 0:
            raise Unavailable(
                f"the request's deadline passed before it reached {runner!r}", reason="late"
            )
        self.waiting[runner] += 1
        try:
            # A runner answers by the call's deadline, or by its batch time limit once the call
            # is in a batch; the slack only bounds a runner process that hangs as a whole.
            limit = self.config.runners[runner].batch_timeout_s
            async with asyncio.timeout(budget + limit + self.config.timeouts.call_slack_s):
                return await self.pools[runner].infer(inputs, rows, budget, group)
        except RunnerFailure as failure:
            raise _failure_error(runner, failure) from None
        except TimeoutError:
            raise Unavailable(f"runner {runner!r} did not answer in time") from None
        finally:
            self.waiting[runner] -= 1

    def _observe(self, runner: str, status: int, started: float, reason: str) -> None:
        elapsed = time.monotonic() - started
        if status == 200:
            duration, count = self._ok[runner]
        else:
            code = str(status)
            duration = request_duration.labels(runner, code)
            count = requests_total.labels(runner, code)
        duration.observe(elapsed)
        count.inc()
        if status == 503:
            counter = self._unavailable.get((runner, reason))
            if counter is None:  # a 503 raised without a reason of its own
                counter = unavailable_total.labels(runner, reason or "unreachable")
            counter.inc()


def _json(content: bytes, status: int = 200) -> Response:
    return Response(content, status, media_type="application/json")


def _is_infer(scope: Scope) -> bool:
    """POST /v2/models/{name}/infer or /v2/models/{name}/versions/{version}/infer."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return False
    parts = scope["path"].split("/")
    return (
        len(parts) in (5, 7) and parts[-1] == "infer" and parts[1] == "v2"
        and parts[2] == "models" and (len(parts) == 5 or parts[4] == "versions")
    )


class App:
    """The ASGI application: inference on the fast path, everything else through Starlette."""

    def __init__(self, service: Service, routes: Starlette) -> None:
        self.service = service
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _is_infer(scope):
            await self.service.infer(scope, receive, send)
        else:
            await self.routes(scope, receive, send)


def create_app(config: Config, addresses: Mapping[str, Sequence[Address]],
               keys: Credentials = NO_KEYS) -> App:
    """The API application over runner processes at `addresses` (runner name -> list),
    reached with `keys`."""
    service = Service(config, addresses, keys)

    def runner_of(request: Request) -> RunnerConfig:
        return service.runner(request.path_params["name"], request.path_params.get("version"))

    async def live(request: Request) -> Response:
        return _json(b"{}")

    async def ready(request: Request) -> Response:
        up = not service.stopping and all(pool.ready for pool in service.pools.values())
        return _json(b'{"ready":true}' if up else b'{"ready":false}', 200 if up else 503)

    async def server_metadata(request: Request) -> Response:
        return _json(protocol.server_metadata())

    async def model_metadata(request: Request) -> Response:
        return _json(protocol.model_metadata(runner_of(request)))

    async def model_ready(request: Request) -> Response:
        up = not service.stopping and service.pools[runner_of(request).name].ready
        return _json(b'{"ready":true}' if up else b'{"ready":false}', 200 if up else 503)

    described = openapi.encode(config)

    async def description(request: Request) -> Response:
        return _json(described)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry()), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for pool in service.pools.values():
            pool.start()
        watcher = asyncio.create_task(watch(service.shedder, record=loop_lag.observe))
        publisher = asyncio.create_task(_publish(service))
        yield
        watcher.cancel()
        publisher.cancel()
        for pool in service.pools.values():
            await pool.close()

    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    routes = [
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
        Route("/metrics", metrics),
        Route("/openapi.json", description),
        *(Route(base, model_metadata) for base in (model, versioned)),
        *(Route(f"{base}/ready", model_ready) for base in (model, versioned)),
    ]
    starlette = Starlette(routes=routes, lifespan=lifespan)
    starlette.add_exception_handler(BatchserveError, _handle)
    return App(service, starlette)


async def _handle(request: Request, exc: Exception) -> Response:
    status, content, headers = error_response(exc)
    return Response(content, status, headers=headers)


async def _publish(service: Service, period_s: float = PUBLISH_S) -> None:
    """Keep this worker's gauges current whether or not requests arrive."""
    while True:
        service.publish()
        await asyncio.sleep(period_s)
