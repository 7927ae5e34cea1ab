"""One gRPC inference call through the exchange HTTP uses, and the status codes of its errors.

`GrpcExchange` is `batchserve.api.service.Exchange` with a protocol buffer for a body: the
same admission, shedding, backlog refusals, deadline, dispatch, splitting and metrics (under
`protocol="grpc"`), with only the reading, the writing and the words of an error its own. The
call's gRPC deadline, when tighter than the runner's `max_latency_ms` (or the request's
`timeout` parameter), becomes the request's deadline.

What HTTP answers with a status, gRPC answers with a code (docs/protocol.md has the table):

    BadRequest                       INVALID_ARGUMENT
    ModelNotFound                    NOT_FOUND
    TooManyRows                      OUT_OF_RANGE       (never fits; HTTP's message, no retry)
    PayloadTooLarge                  RESOURCE_EXHAUSTED
    NotSupported                     UNIMPLEMENTED
    Unavailable (reason expired, late), ModelTimeout
                                     DEADLINE_EXCEEDED
    Unavailable (any other reason)   UNAVAILABLE
    anything else                    INTERNAL

A refusal under load carries, as HTTP's 503 does, its reason and the computed retry delay, in
trailing metadata: `retry-after` (whole seconds, as HTTP's header), `batchserve-reason`, and
the numbers behind it (`batchserve-predicted-ms`, ...).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any, Final

import grpc

from ...runner.core.config import RunnerConfig
from ...runner.core.types import Tensors
from .. import admission, protocol
from ..errors import (
    BadRequest,
    BatchserveError,
    ModelNotFound,
    ModelTimeout,
    NotSupported,
    PayloadTooLarge,
    TooManyRows,
    Unavailable,
)
from ..service import Exchange, Respond, Service
from . import codec

__all__ = ["CODE", "GrpcExchange", "message_of", "refusal_of", "status_of", "trailers_of"]

CODE: Final = "grpc-status"
"""The key of a refusal's headers that carries its gRPC code's name, for the handler."""

_CODES: Final[tuple[tuple[type[BatchserveError], grpc.StatusCode], ...]] = (
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (TooManyRows, grpc.StatusCode.OUT_OF_RANGE),
    (PayloadTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotSupported, grpc.StatusCode.UNIMPLEMENTED),
    (ModelTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
)
_EXPIRED: Final = frozenset({"expired", "late"})


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC code of an error the exchange (or a route) raised."""
    if isinstance(exc, Unavailable):
        return (grpc.StatusCode.DEADLINE_EXCEEDED if exc.reason in _EXPIRED
                else grpc.StatusCode.UNAVAILABLE)
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def trailers_of(exc: BaseException) -> dict[str, str]:
    """A refusal's reason and retry delay, as trailing metadata (nothing for other errors)."""
    if not isinstance(exc, Unavailable):
        return {}
    found = {"retry-after": str(math.ceil(max(exc.retry_after, 0.0))),
             "batchserve-reason": exc.reason}
    for key, value in exc.details.items():
        found["batchserve-" + key.replace("_", "-")] = f"{value:g}"
    return found


def message_of(exc: BaseException) -> str:
    return exc.message if isinstance(exc, BatchserveError) else "internal server error"


class GrpcExchange(Exchange):
    """One `ModelInfer` call, or one request of a `ModelStreamInfer` stream."""

    PROTOCOL = "grpc"

    __slots__ = ("deadline", "message")

    def __init__(self, service: Service, name: str, respond: Respond,
                 time_remaining: float | None, message: Any) -> None:
        super().__init__(service, name, respond)
        self.deadline = None if time_remaining is None else self.started + time_remaining
        self.message = message  # the request, parsed once on arrival (`codec.read_request`)

    def decode_rate(self, runner: RunnerConfig, header_length: str | None
                    ) -> admission.DecodeRate | None:
        return None  # a rate of JSON bodies: protocol buffers decode at another

    def decode(self, body: bytes, header_length: str | None, runner: RunnerConfig
               ) -> protocol.InferRequest:
        """The tensors of the request parsed on arrival; `body` is its bytes, already read."""
        left = None if self.deadline is None else self.deadline - time.monotonic()
        return codec.decode_infer(self.message, runner, left)

    def encode(self, runner: RunnerConfig, call: protocol.InferRequest, outputs: Tensors
               ) -> tuple[bytes, Mapping[str, str]]:
        return codec.encode_infer(runner, call, outputs), {}

    def refusal(self, exc: BaseException) -> tuple[int, bytes, Mapping[str, str]]:
        return refusal_of(exc)


def refusal_of(exc: BaseException) -> tuple[int, bytes, Mapping[str, str]]:
    """The HTTP status the same error gets (the metrics' `code`), the message, and the
    trailing metadata with the gRPC code under `CODE`."""
    status = exc.status if isinstance(exc, BatchserveError) else 500
    return status, message_of(exc).encode(), {CODE: status_of(exc).name, **trailers_of(exc)}
