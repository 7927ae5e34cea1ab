"""Every error the API tier answers with, each carrying its HTTP status.

    BatchserveError            500  a bug or an unexpected state on the server's side
    ├── BadRequest             400  malformed body, unknown input, wrong datatype or shape
    ├── ModelNotFound          404  no runner serves the model named in the URL
    ├── RouteNotFound          404  no route has this path
    ├── MethodNotAllowed       405  the path is a route, not for this method; with `Allow`
    ├── PayloadTooLarge        413  the body is over `api.max_body_bytes`
    ├── TooManyRows            413  more rows than can be decoded and run within the latency
    │                               limit even on an idle server
    ├── NotSupported           501  a v2 or Triton extension batchserve does not offer
    ├── ModelTimeout           504  the model call ran past the runner's `batch_timeout_ms`
    └── Unavailable            503  try again later; answered with `Retry-After`
        ├── RunnerUnavailable       the runner process is draining: it stops or restarts
        ├── SloRefused              the runner refused: its queue cannot answer within the limit
        ├── BacklogRefused          the same judged by the API worker, on the runner's backlog
        ├── PipelineRefused         a pipeline's steps, under their queues, would miss its limit
        ├── Overloaded              the API worker is behind and sheds load at the front
        └── Stopping                the server is draining before it exits

Every 503 carries a `reason`, the label it is counted under in
`batchserve_unavailable_total`: `queue` (refused at arrival), `expired` and `draining` are the
runner's own answers (the same reasons as its `batchserve_rejections_total`), and `draining`
is also an API worker's answer while it drains; `front` is the API worker's own shedding;
`unreachable` a runner process that is down, not connected, went away or did not answer;
`late` a request whose deadline passed before it was sent to a runner; `pipeline` a pipeline's
request refused at its entrance, or between steps, because its steps would not fit its limit.

Library code raises these; one handler, `error_response`, turns any exception into the
JSON body `{"error": "..."}` and its headers, so every route answers errors the same way. A
503's body also names its `reason` and the numbers behind it, as
`{"error": "...", "reason": "front", "lag_ms": 212.0}`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import ClassVar

import orjson

__all__ = [
    "BadRequest",
    "BatchserveError",
    "ModelNotFound",
    "MethodNotAllowed",
    "ModelTimeout",
    "NotSupported",
    "Overloaded",
    "PayloadTooLarge",
    "PipelineRefused",
    "RouteNotFound",
    "RunnerUnavailable",
    "SloRefused",
    "BacklogRefused",
    "Stopping",
    "TooManyRows",
    "Unavailable",
    "error_response",
]


class BatchserveError(Exception):
    """Base of the hierarchy; an error that escapes unclassified is the server's fault."""

    status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(BatchserveError):
    """The request cannot be served as sent; the message says what was expected."""

    status = 400


class ModelNotFound(BatchserveError):
    status = 404

    def __init__(self, model: str, known: Iterable[str] = ()) -> None:
        names = ", ".join(sorted(known))
        hint = f"; known models: {names}" if names else ""
        super().__init__(f"model {model!r} is not served here{hint}")
        self.model = model


class RouteNotFound(BatchserveError):
    """No route has this path: the message points at where the routes are listed, since a
    client that guessed a path wants to know the right one."""

    status = 404

    def __init__(self, method: str, path: str) -> None:
        super().__init__(
            f"no route {method} {path}; every route is listed at GET /openapi.json "
            "(the served models at POST /v2/repository/index)"
        )


class MethodNotAllowed(BatchserveError):
    """The path is a route, for other methods: answered with `Allow` listing them."""

    status = 405

    def __init__(self, method: str, path: str, allow: Iterable[str]) -> None:
        self.allow = ", ".join(allow)
        super().__init__(f"{path} does not take {method}; it takes {self.allow}")


class NotSupported(BatchserveError):
    """A protocol extension batchserve does not offer (shared memory, model control, trace
    and log settings): the client learns so from the status, not from a route that is
    missing."""

    status = 501


class PayloadTooLarge(BatchserveError):
    status = 413

    def __init__(self, limit: int, size: int | None = None) -> None:
        # `size` is unknown while a chunked body is still arriving.
        got = f"of {size} bytes " if size is not None else ""
        super().__init__(f"request body {got}exceeds the limit of {limit} bytes")
        self.limit = limit
        self.size = size


class TooManyRows(BatchserveError):
    """More rows (or elements) than can be decoded and run within the latency limit even on
    an idle server: waiting cannot help, so no Retry-After; the message names the rows, the
    time they need, the limit and how many would fit."""

    status = 413


class ModelTimeout(BatchserveError):
    """The model did not finish the request's batch within the runner's time limit."""

    status = 504


class Unavailable(BatchserveError):
    """A transient refusal: the client should retry after `retry_after` seconds. Its body
    names `reason` and carries `details`, the numbers behind it, for clients to act on."""

    status = 503

    def __init__(self, message: str, retry_after: float = 1.0, reason: str = "unreachable",
                 details: Mapping[str, float] | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason
        self.details = dict(details or {})


class RunnerUnavailable(Unavailable):
    def __init__(self, runner: str, retry_after: float = 1.0) -> None:
        super().__init__(
            f"runner {runner!r} is not available (its process is stopping or restarting); "
            "retry shortly",
            retry_after,
            "draining",
        )
        self.runner = runner


class SloRefused(Unavailable):
    """The runner refused at arrival; `details` holds what it judged on, when it says: the
    predicted finish and the deadline (ms after the request reached it), the rows ahead."""

    def __init__(self, runner: str, retry_after: float = 1.0,
                 details: Mapping[str, float] | None = None) -> None:
        super().__init__(
            f"runner {runner!r} refused the request: it cannot be answered within the "
            "runner's latency limit; retry later",
            retry_after,
            "queue",
            details,
        )
        self.runner = runner


class BacklogRefused(Unavailable):
    """Refused by the API worker on the backlog the runner process published: what is left
    of it would not let the request finish within its budget (`batchserve.api.backlog`)."""

    def __init__(self, runner: str, retry_after: float, details: Mapping[str, float]) -> None:
        super().__init__(
            f"runner {runner!r} refused the request: its backlog cannot be served within the "
            "request's latency limit; retry later",
            retry_after,
            "backlog",
            details,
        )
        self.runner = runner


class PipelineRefused(Unavailable):
    """Refused by the API worker for a pipeline: its steps' predicted times, under their
    queues of the moment, add up to more than the request's budget (`batchserve.api.chain`);
    it names the step that weighs most, the one whose queue is to blame."""

    def __init__(self, pipeline: str, step: int, runner: str, retry_after: float,
                 details: Mapping[str, float]) -> None:
        super().__init__(
            f"pipeline {pipeline!r} refused the request: its steps cannot be served within "
            f"its latency limit (step {step}, runner {runner!r}, weighs most); retry later",
            retry_after,
            "pipeline",
            details,
        )
        self.runner = runner


class Overloaded(Unavailable):
    """Shed at the front; `why` says how the worker is behind (its `reason` is `front`)."""

    def __init__(self, why: str, retry_after: float = 1.0,
                 details: Mapping[str, float] | None = None) -> None:
        super().__init__(f"the server is overloaded ({why}); retry later", retry_after,
                         "front", details)
        self.why = why


class Stopping(Unavailable):
    """The API worker is draining: it takes no new work, and its answer closes the connection
    so a client's next request opens a fresh one (to a server that still serves)."""

    def __init__(self, why: str = "the server is stopping; retry shortly") -> None:
        super().__init__(why, 1.0, "draining")


_JSON = "application/json"


def error_response(exc: BaseException) -> tuple[int, bytes, dict[str, str]]:
    """Map any exception to (status, JSON body, headers); foreign ones become a bare 500."""
    if not isinstance(exc, BatchserveError):
        # Its text may hold internals (paths, reprs); the handler logs it, the client gets none.
        return 500, b'{"error":"internal server error"}', {"Content-Type": _JSON}
    headers = {"Content-Type": _JSON}
    if isinstance(exc, Unavailable):
        body = orjson.dumps({"error": exc.message, "reason": exc.reason, **exc.details})
        # HTTP wants whole seconds (RFC 9110 §10.2.3); round up so a short wait never says 0.
        headers["Retry-After"] = str(math.ceil(max(exc.retry_after, 0.0)))
    else:
        body = orjson.dumps({"error": exc.message})
    if isinstance(exc, MethodNotAllowed):
        headers["Allow"] = exc.allow
    if isinstance(exc, Stopping):
        headers["Connection"] = "close"
    return exc.status, body, headers
