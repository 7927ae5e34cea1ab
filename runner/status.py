"""A runner's own HTTP endpoints when it runs apart from `batchserve serve`.

A runner on another host has no API worker beside it to merge its metrics, so it serves them
itself, with its health, on `--metrics-port`:

    GET /metrics        this process's metrics (every process's, under PROMETHEUS_MULTIPROC_DIR)
    GET /health/live    200 while the process's event loop runs
    GET /health/ready   200 while it takes calls; 503 once it drains

uvicorn runs in the runner's own event loop, so a loop that is stuck stops answering too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .metrics import registry


def status_app(ready: Callable[[], bool]) -> Starlette:
    """The endpoints above; `ready` says whether the runner takes calls."""

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry()), media_type=CONTENT_TYPE_LATEST)

    async def live(request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    async def readiness(request: Request) -> Response:
        up = ready()
        return Response(b'{"ready":true}' if up else b'{"ready":false}',
                        200 if up else 503, media_type="application/json")

    return Starlette(routes=[Route("/metrics", metrics), Route("/health/live", live),
                             Route("/health/ready", readiness)])


class StatusServer(uvicorn.Server):
    """uvicorn inside the runner's loop: the runner owns the signals, so it leaves them be."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    @property
    def port(self) -> int:
        """The port bound (useful with port 0)."""
        return int(self.servers[0].sockets[0].getsockname()[1])


def status_server(host: str, port: int, ready: Callable[[], bool]) -> StatusServer:
    return StatusServer(uvicorn.Config(
        status_app(ready), host=host, port=port, lifespan="off", access_log=False,
        log_level="warning",
    ))
