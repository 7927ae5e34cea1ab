"""The HTTP front: Open Inference Protocol v2 routes over the runner pools.

Each request is decoded and checked against the runner's signature here, so a runner only
ever sees tensors that fit; its deadline starts when the request arrives, and whatever time
is left is what the runner is given. Errors of every kind leave through `error_response`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api import protocol
from api.dispatch import Pool, RunnerFailure
from api.errors import (
    BadRequest,
    BatchserveError,
    ModelNotFound,
    PayloadTooLarge,
    RunnerUnavailable,
    SloRefused,
    Unavailable,
    error_response,
)
from runner.config import Config, RunnerConfig
from runner.metrics import SECONDS_BUCKETS
from runner.wire import Address, FailureCode, Tensors

log = logging.getLogger(__name__)
VERSION = "1"
# A runner answers every call by its deadline; this only bounds a runner that hangs.
HANG_SLACK_S = 2.0

request_duration = Histogram(
    "batchserve_request_duration_seconds", "Inference requests from arrival to answer",
    ["runner", "code"], buckets=SECONDS_BUCKETS,
)
requests_total = Counter(
    "batchserve_requests_total", "Inference requests answered", ["runner", "code"]
)


def _failure_error(runner: str, failure: RunnerFailure) -> BatchserveError:
    """What a runner's failure code means to an HTTP client."""
    detail = failure.failure
    retry = max(detail.retry_after_s, 1.0)
    if detail.code == FailureCode.INVALID:
        return BadRequest(detail.message)
    if detail.code == FailureCode.REFUSED:
        return SloRefused(runner, retry)
    if detail.code == FailureCode.EXPIRED:
        return Unavailable(detail.message, retry)
    if detail.code == FailureCode.STOPPING:
        return RunnerUnavailable(runner, retry)
    return BatchserveError(detail.message)


class Service:
    """The routes' state: the configuration and one pool per runner."""

    def __init__(self, config: Config, addresses: Mapping[str, Sequence[Address]]) -> None:
        self.config = config
        self.pools = {name: Pool(name, addresses.get(name, ())) for name in config.runners}
        self._metrics = {
            name: (request_duration.labels(name, "200"), requests_total.labels(name, "200"))
            for name in config.runners
        }

    def runner(self, request: Request) -> RunnerConfig:
        name = request.path_params["name"]
        runner = self.config.runners.get(name)
        version = request.path_params.get("version")
        if runner is None or version not in (None, VERSION):
            label = name if version is None else f"{name} version {version}"
            raise ModelNotFound(label, self.config.runners)
        return runner

    async def body(self, request: Request) -> bytes:
        limit = self.config.api.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise PayloadTooLarge(limit, int(length))
        if length is not None:
            return await request.body()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def infer(self, request: Request) -> Response:
        started = time.monotonic()
        runner = self.runner(request)
        try:
            response = await self._infer(request, runner, started)
        except Exception as exc:
            response = self._error(exc)
        self._observe(runner.name, response.status_code, started)
        return response

    async def _infer(self, request: Request, runner: RunnerConfig, started: float) -> Response:
        body = await self.body(request)
        header = protocol.parse_header_length(request.headers.get(protocol.HEADER_LENGTH))
        call = protocol.decode_infer(body, header, runner)
        limit = runner.batching.max_latency_ms / 1000
        if call.timeout_s is not None:
            limit = min(limit, call.timeout_s)
        budget = limit - (time.monotonic() - started)
        outputs = await self._call(runner.name, call.inputs, budget)
        content, headers = protocol.encode_infer(runner.name, call, outputs, runner)
        return Response(content, headers=headers)

    async def _call(self, runner: str, inputs: Tensors, budget: float) -> Tensors:
        if budget <= 0:
            raise Unavailable(f"the request's deadline passed before it reached {runner!r}")
        try:
            return await asyncio.wait_for(
                self.pools[runner].infer(inputs, budget), budget + HANG_SLACK_S
            )
        except RunnerFailure as failure:
            raise _failure_error(runner, failure) from None
        except TimeoutError:
            raise RunnerUnavailable(runner) from None

    def _observe(self, runner: str, status: int, started: float) -> None:
        elapsed = time.monotonic() - started
        if status == 200:
            duration, count = self._metrics[runner]
        else:
            code = str(status)
            duration, count = request_duration.labels(runner, code), requests_total.labels(
                runner, code
            )
        duration.observe(elapsed)
        count.inc()

    @staticmethod
    def _error(exc: BaseException) -> Response:
        if not isinstance(exc, BatchserveError):
            log.exception("unexpected error answering a request", exc_info=exc)
        status, content, headers = error_response(exc)
        return Response(content, status, headers=headers)


def _json(content: bytes, status: int = 200) -> Response:
    return Response(content, status, media_type="application/json")


def create_app(config: Config, addresses: Mapping[str, Sequence[Address]]) -> Starlette:
    """The API application over runner processes at `addresses` (runner name -> list)."""
    service = Service(config, addresses)

    async def live(request: Request) -> Response:
        return _json(b"{}")

    async def ready(request: Request) -> Response:
        up = all(pool.ready for pool in service.pools.values())
        return _json(b'{"ready":true}' if up else b'{"ready":false}', 200 if up else 503)

    async def server_metadata(request: Request) -> Response:
        return _json(protocol.server_metadata())

    async def model_metadata(request: Request) -> Response:
        return _json(protocol.model_metadata(service.runner(request)))

    async def model_ready(request: Request) -> Response:
        runner = service.runner(request)
        up = service.pools[runner.name].ready
        return _json(b'{"ready":true}' if up else b'{"ready":false}', 200 if up else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(_registry()), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for pool in service.pools.values():
            pool.start()
        yield
        for pool in service.pools.values():
            await pool.close()

    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    routes = [
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
        Route("/metrics", metrics),
        *(Route(base, model_metadata) for base in (model, versioned)),
        *(Route(f"{base}/ready", model_ready) for base in (model, versioned)),
        *(Route(f"{base}/infer", service.infer, methods=["POST"]) for base in (model, versioned)),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_exception_handler(BatchserveError, _handle)
    return app


async def _handle(request: Request, exc: Exception) -> Response:
    return Service._error(exc)


def _registry() -> CollectorRegistry:
    """Every process's metrics when the supervisor gave them one folder, else this one's."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry
