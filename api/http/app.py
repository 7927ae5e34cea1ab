"""The ASGI application: the v2 routes over the runner pools.

Inference is answered by `batchserve.api.service`; in a worker, its HTTP connections
(`batchserve.api.http.connection`) hand inference requests to the service directly and bring only
the other routes here, through Starlette. `App` also answers inference itself, over ASGI, for
callers that run the app in-process (tests, `httpx.ASGITransport`).

An API worker sets no timer while idle: the lag watch (`batchserve.api.overload.watch`) runs
only while requests are in flight or the front still sheds, and republishes the worker's live
gauges while it does and once more when the worker falls idle; a runner connection that comes
or goes republishes them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ...runner.core.config import Config, RunnerConfig
from ...runner.core.security import Credentials
from ...runner.core.timeouts import Timeouts
from ...runner.core.wire import Address
from ...runner.metrics import SECONDS_BUCKETS, registry
from .. import protocol, statistics, triton
from ..dispatch import NO_KEYS
from ..errors import (
    BadRequest,
    BatchserveError,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
    error_response,
)
from ..overload import watch
from ..service import Service, infer_target
from . import openapi

log = logging.getLogger(__name__)

loop_lag = Histogram(
    "batchserve_api_loop_lag_seconds",
    "How late each API worker's event loop ran a timer due every 10 ms while requests were "
    "in flight: what a request waits in a worker before any of its code sees it",
    buckets=SECONDS_BUCKETS,
)


def _raw_headers(headers: Mapping[str, str], length: int) -> list[tuple[bytes, bytes]]:
    raw = [(name.lower().encode("latin-1"), value.encode("latin-1"))
           for name, value in headers.items()]
    raw.append((b"content-length", b"%d" % length))
    return raw


async def _body(receive: Receive, length: str | None, limit: int) -> bytes:
    """The whole request body from ASGI messages, refused past `limit` bytes."""
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


async def infer_asgi(service: Service, scope: Scope, receive: Receive, send: Send) -> None:
    """POST /v2/models/{name}[/versions/{version}]/infer, over ASGI."""
    target = infer_target(scope["path"])
    assert target is not None
    answered: asyncio.Future[tuple[int, bytes, Mapping[str, str]]] = (
        asyncio.get_running_loop().create_future())

    def respond(status: int, content: bytes, headers: Mapping[str, str]) -> None:
        answered.set_result((status, content, headers))

    exchange = service.request(*target, respond)
    if not exchange.done:
        length = header_length = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = value.decode("latin-1")
            elif key == b"inference-header-content-length":
                header_length = value.decode("latin-1")
        try:
            body = await _body(receive, length, service.config.api.max_body_bytes)
        except BatchserveError as exc:
            exchange.fail(exc)
        else:
            exchange.run(body, header_length)
    status, content, headers = await answered
    await send({"type": "http.response.start", "status": status,
                "headers": _raw_headers(headers, len(content))})
    await send({"type": "http.response.body", "body": content})


def _json(content: bytes, status: int = 200) -> Response:
    return Response(content, status, media_type="application/json")


def _is_infer(scope: Scope) -> bool:
    """POST /v2/models/{name}/infer or /v2/models/{name}/versions/{version}/infer."""
    return (scope["type"] == "http" and scope["method"] == "POST"
            and infer_target(scope["path"]) is not None)


class App:
    """The ASGI application: inference through the service, everything else through
    Starlette."""

    def __init__(self, service: Service, routes: Starlette) -> None:
        self.service = service
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _is_infer(scope):
            await infer_asgi(self.service, scope, receive, send)
        else:
            await self.routes(scope, receive, send)


async def _linked(service: Service, within_s: float) -> None:
    """Wait until the service is ready (every runner has a connected process, as
    `/v2/health/ready` says), for `within_s` at most: a worker that reported serving before
    its links had passed their handshakes answered its first requests 503 (`unreachable`).
    A runner still down after that is the readiness check's to report, and this worker
    serves the others meanwhile."""
    deadline = time.monotonic() + within_s
    while not service.ready and time.monotonic() < deadline:  # noqa: ASYNC110 - to a deadline
        await asyncio.sleep(Timeouts.POLL_S)


def create_app(config: Config, addresses: Mapping[str, Sequence[Address]],
               keys: Credentials = NO_KEYS) -> App:
    """The API application over runner processes at `addresses` (runner name -> list),
    reached with `keys`."""
    service = Service(config, addresses, keys)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for pool in service.pools.values():
            pool.start()
        await _linked(service, config.timeouts.hello_timeout_s)
        service.publish()
        watcher = asyncio.create_task(watch(
            service.shedder, lambda: service.busy, service.arrived, record=loop_lag.observe,
            publish=service.publish))
        yield
        watcher.cancel()
        service.flush()
        for pool in service.pools.values():
            await pool.close()

    starlette = Starlette(routes=_routes(service, config), lifespan=lifespan)
    starlette.add_exception_handler(BatchserveError, _handle)
    starlette.add_exception_handler(HTTPException, _handle_http)
    return App(service, starlette)


def _versioned(path: str, endpoint: Any, methods: Sequence[str] = ("GET",)) -> list[Route]:
    """The route under `/v2/models/{name}` and under `.../versions/{version}`."""
    return [Route(f"/v2/models/{{name}}{version}{path}", endpoint, methods=list(methods))
            for version in ("", "/versions/{version}")]


def _unsupported(extension: str) -> Any:
    async def refuse(request: Request) -> Response:
        raise triton.unsupported(extension)
    return refuse


def _extensions() -> list[Route]:
    """Triton's extensions batchserve does not offer, each answered 501 with why."""
    both = ["GET", "POST"]
    routes = [Route("/v2/repository/models/{name}/" + verb, _unsupported("load"),
                    methods=["POST"]) for verb in ("load", "unload")]
    for memory in ("systemsharedmemory", "cudasharedmemory"):
        for base in (f"/v2/{memory}", f"/v2/{memory}/region/{{region}}"):
            routes.append(Route(f"{base}/status", _unsupported(memory)))
            routes += [Route(f"{base}/{verb}", _unsupported(memory), methods=["POST"])
                       for verb in ("register", "unregister")]
    routes.append(Route("/v2/logging", _unsupported("logging"), methods=both))
    routes.append(Route("/v2/trace/setting", _unsupported("trace"), methods=both))
    routes += _versioned("/trace/setting", _unsupported("trace"), both)
    return routes


def _routes(service: Service, config: Config) -> list[Route]:
    """Every route but inference's fast path, which `App` and the connection take first."""

    def runner_of(request: Request) -> RunnerConfig:
        return service.runner(request.path_params["name"], request.path_params.get("version"))

    async def live(request: Request) -> Response:
        return _json(b'{"live":true}')

    async def ready(request: Request) -> Response:
        up = service.ready
        return _json(b'{"ready":true}' if up else b'{"ready":false}', 200 if up else 503)

    async def server_metadata(request: Request) -> Response:
        return _json(protocol.server_metadata())

    async def model_metadata(request: Request) -> Response:
        runner = runner_of(request)
        return _json(protocol.model_metadata(runner, runner.name in config.pipelines))

    async def model_ready(request: Request) -> Response:
        up = service.model_ready(runner_of(request).name)
        return _json(b'{"ready":true}' if up else b'{"ready":false}', 200 if up else 503)

    async def model_config(request: Request) -> Response:
        runner = runner_of(request)
        return _json(triton.model_config(runner, config.pipelines.get(runner.name)))

    async def model_stats(request: Request) -> Response:
        names = ([runner_of(request).name] if "name" in request.path_params
                 else list(service.models))
        return _json(statistics.encode(names, registry()))

    async def repository_index(request: Request) -> Response:
        body = await _small_body(request)
        unready = {name: ("the server is stopping" if service.stopping else
                          None if service.model_ready(name)
                          else "no process of its runner is connected")
                   for name in service.models}
        return _json(triton.repository_index(unready, body))

    described = openapi.encode(config)

    async def description(request: Request) -> Response:
        return _json(described)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry()), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
        Route("/metrics", metrics),
        Route("/openapi.json", description),
        Route("/v2/models/stats", model_stats),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        *_versioned("", model_metadata),
        *_versioned("/ready", model_ready),
        *_versioned("/config", model_config),
        *_versioned("/stats", model_stats),
        *_versioned("/infer", functools.partial(infer_asgi, service), ["POST"]),
        *_extensions(),
    ]


SMALL_BODY = 65536
"""The most a request to a route other than inference may send: a few flags at most."""


async def _small_body(request: Request) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > SMALL_BODY:
            raise PayloadTooLarge(SMALL_BODY)
        chunks.append(chunk)
    return b"".join(chunks)


async def _handle(request: Request, exc: Exception) -> Response:
    status, content, headers = error_response(exc)
    return Response(content, status, headers=headers)


async def _handle_http(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, in the protocol's JSON like every other error."""
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    error: BatchserveError
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        # Starlette keeps a route's methods in a set: sorted, the header reads the same always.
        error = MethodNotAllowed(method, path, sorted(allow.split(", ")))
    elif exc.status_code == 404:
        error = RouteNotFound(method, path)
    else:
        error = BadRequest(exc.detail) if exc.status_code == 400 else BatchserveError(exc.detail)
    return await _handle(request, error)
