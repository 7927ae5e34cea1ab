"""How the client's calls reach the server: HTTP (httpx) or gRPC (grpcio), blocking or asyncio.

A transport makes the two calls every front end needs, the model's metadata and one inference
of checked inputs, each within the seconds left to the call's deadline. It answers with the
result, raises `Retry` when the server refused with a delay that fits in what is left, and
raises the client's own errors otherwise (`batchserve.api.client.codec`); the front ends
retry, chunk and join. The URL picks one: `http://HOST:PORT` (or `https://`) speaks v2 over
HTTP, `grpc://HOST:PORT` the v2 gRPC service (without TLS).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final, Protocol
from urllib.parse import quote

import grpc
import httpx
import orjson

from ...runner.core.types import Tensors
from .codec import (
    DeadlineExceeded,
    ModelMetadata,
    Parameters,
    ServerError,
    check_answer,
    decode_response,
    encode_request,
)
from .grpc_codec import (
    METHODS,
    check_status,
    decode_infer,
    encode_infer,
    metadata_of,
    metadata_request,
)

__all__ = ["AsyncTransport", "GRPC_SCHEME", "Retry", "Transport", "async_transport",
           "transport"]

GRPC_SCHEME: Final = "grpc://"


class Retry(Exception):  # noqa: N818 - not an error: the server asked to be asked again
    """The server refused with a delay that fits the deadline: try again after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(delay_s)
        self.delay_s = delay_s


class Transport(Protocol):
    def metadata(self, remaining_s: float) -> ModelMetadata: ...

    def infer(self, inputs: Tensors, metadata: ModelMetadata, binary: bool,
              parameters: Parameters, remaining_s: float) -> Tensors: ...

    def close(self) -> None: ...


class AsyncTransport(Protocol):
    async def metadata(self, remaining_s: float) -> ModelMetadata: ...

    async def infer(self, inputs: Tensors, metadata: ModelMetadata, binary: bool,
                    parameters: Parameters, remaining_s: float) -> Tensors: ...

    async def aclose(self) -> None: ...


def transport(url: str, model: str, timeout_s: float) -> Transport:
    """The blocking transport `url` names."""
    if url.startswith(GRPC_SCHEME):
        return GrpcTransport(url.removeprefix(GRPC_SCHEME), model)
    return HttpTransport(url, model, timeout_s)


def async_transport(url: str, model: str, timeout_s: float) -> AsyncTransport:
    """The asyncio transport `url` names."""
    if url.startswith(GRPC_SCHEME):
        return AsyncGrpcTransport(url.removeprefix(GRPC_SCHEME), model)
    return AsyncHttpTransport(url, model, timeout_s)


# --- HTTP ---------------------------------------------------------------------------------------


def _metadata(answer: httpx.Response) -> ModelMetadata:
    try:
        document = orjson.loads(answer.content)
    except orjson.JSONDecodeError:
        raise ServerError(answer.status_code, "the model metadata is not JSON") from None
    return ModelMetadata.parse(document)


def _timed_out(exc: httpx.TimeoutException) -> DeadlineExceeded:
    return DeadlineExceeded(f"no answer within the call's deadline ({type(exc).__name__})")


def _checked(answer: httpx.Response, started: float, remaining_s: float) -> httpx.Response:
    delay = check_answer(answer.status_code, answer.headers, answer.content,
                         remaining_s - (time.monotonic() - started))
    if delay is not None:
        raise Retry(delay)
    return answer


class HttpTransport:
    """v2 over HTTP with httpx: `GET /v2/models/{name}`, `POST .../infer`."""

    def __init__(self, url: str, model: str, timeout_s: float) -> None:
        self._http = httpx.Client(base_url=url, timeout=timeout_s)
        self._path = f"/v2/models/{quote(model, safe='')}"

    def metadata(self, remaining_s: float) -> ModelMetadata:
        started = time.monotonic()
        try:
            answer = self._http.get(self._path, timeout=remaining_s)
        except httpx.TimeoutException as exc:
            raise _timed_out(exc) from None
        return _metadata(_checked(answer, started, remaining_s))

    def infer(self, inputs: Tensors, metadata: ModelMetadata, binary: bool,
              parameters: Parameters, remaining_s: float) -> Tensors:
        started = time.monotonic()
        body, headers = encode_request(inputs, metadata, binary, remaining_s, parameters)
        try:
            answer = self._http.post(self._path + "/infer", content=body, headers=headers,
                                     timeout=remaining_s)
        except httpx.TimeoutException as exc:
            raise _timed_out(exc) from None
        answer = _checked(answer, started, remaining_s)
        return decode_response(answer.headers, answer.content)

    def close(self) -> None:
        self._http.close()


class AsyncHttpTransport:
    """As `HttpTransport`, over httpx's async client."""

    def __init__(self, url: str, model: str, timeout_s: float) -> None:
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout_s)
        self._path = f"/v2/models/{quote(model, safe='')}"

    async def metadata(self, remaining_s: float) -> ModelMetadata:
        started = time.monotonic()
        try:
            answer = await self._http.get(self._path, timeout=remaining_s)
        except httpx.TimeoutException as exc:
            raise _timed_out(exc) from None
        return _metadata(_checked(answer, started, remaining_s))

    async def infer(self, inputs: Tensors, metadata: ModelMetadata, binary: bool,
                    parameters: Parameters, remaining_s: float) -> Tensors:
        started = time.monotonic()
        body, headers = encode_request(inputs, metadata, binary, remaining_s, parameters)
        try:
            answer = await self._http.post(self._path + "/infer", content=body,
                                           headers=headers, timeout=remaining_s)
        except httpx.TimeoutException as exc:
            raise _timed_out(exc) from None
        answer = _checked(answer, started, remaining_s)
        return decode_response(answer.headers, answer.content)

    async def aclose(self) -> None:
        await self._http.aclose()


# --- gRPC ---------------------------------------------------------------------------------------


def _failed(exc: grpc.RpcError, started: float, remaining_s: float) -> Exception:
    """What a failed call raises: `Retry`, a deadline of the client's own that passed, or the
    error HTTP would have raised for the same decision."""
    code, details = exc.code(), exc.details()
    trailers = exc.trailing_metadata()
    left_s = remaining_s - (time.monotonic() - started)
    reasoned = any(key == "batchserve-reason" for key, _ in trailers or ())
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not reasoned and (
            left_s <= 0 or details == "Deadline Exceeded"):
        return DeadlineExceeded("no answer within the call's deadline (DEADLINE_EXCEEDED)")
    try:
        return Retry(check_status(code, details, trailers, left_s))
    except Exception as error:
        return error


class _Calls:
    """The three calls as callables of serialized bytes, on one channel."""

    def __init__(self, channel: Any, model: str) -> None:
        self.channel = channel
        self.model = model
        self.request = metadata_request(model)
        self.call: dict[str, Callable[..., Any]] = {
            name: channel.unary_unary(method) for name, method in METHODS.items()
        }


class GrpcTransport:
    """v2 over gRPC with grpcio's blocking channel: `ModelMetadata` and `ModelConfig` once,
    then `ModelInfer`, each with the deadline left as its gRPC deadline."""

    def __init__(self, target: str, model: str) -> None:
        self._calls = _Calls(grpc.insecure_channel(target), model)

    def metadata(self, remaining_s: float) -> ModelMetadata:
        started, calls = time.monotonic(), self._calls
        try:
            described = calls.call["ModelMetadata"](calls.request, timeout=remaining_s)
            left_s = remaining_s - (time.monotonic() - started)
            config = calls.call["ModelConfig"](calls.request, timeout=max(left_s, 1e-3))
        except grpc.RpcError as exc:
            raise _failed(exc, started, remaining_s) from None
        return metadata_of(described, config)

    def infer(self, inputs: Tensors, metadata: ModelMetadata, binary: bool,
              parameters: Parameters, remaining_s: float) -> Tensors:
        started = time.monotonic()
        body = encode_infer(self._calls.model, inputs, metadata, binary, parameters)
        try:
            answer = self._calls.call["ModelInfer"](body, timeout=remaining_s)
        except grpc.RpcError as exc:
            raise _failed(exc, started, remaining_s) from None
        return decode_infer(answer)

    def close(self) -> None:
        self._calls.channel.close()


class AsyncGrpcTransport:
    """As `GrpcTransport`, over `grpc.aio`; the channel opens on the first call's loop."""

    def __init__(self, target: str, model: str) -> None:
        self._target, self._model = target, model
        self._calls: _Calls | None = None

    def _open(self) -> _Calls:
        if self._calls is None:
            self._calls = _Calls(grpc.aio.insecure_channel(self._target), self._model)
        return self._calls

    async def metadata(self, remaining_s: float) -> ModelMetadata:
        started, calls = time.monotonic(), self._open()
        try:
            described = await calls.call["ModelMetadata"](calls.request, timeout=remaining_s)
            left_s = remaining_s - (time.monotonic() - started)
            config = await calls.call["ModelConfig"](calls.request, timeout=max(left_s, 1e-3))
        except grpc.RpcError as exc:
            raise _failed(exc, started, remaining_s) from None
        return metadata_of(described, config)

    async def infer(self, inputs: Tensors, metadata: ModelMetadata, binary: bool,
                    parameters: Parameters, remaining_s: float) -> Tensors:
        started, calls = time.monotonic(), self._open()
        body = encode_infer(calls.model, inputs, metadata, binary, parameters)
        try:
            answer = await calls.call["ModelInfer"](body, timeout=remaining_s)
        except grpc.RpcError as exc:
            raise _failed(exc, started, remaining_s) from None
        return decode_infer(answer)

    async def aclose(self) -> None:
        if self._calls is not None:
            await self._calls.channel.close()
