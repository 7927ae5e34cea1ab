"""The gRPC server of one API worker: `inference.GRPCInferenceService` and the standard
`grpc.health.v1.Health`, on `api.grpc_port`, on the worker's own event loop beside uvicorn.

Every API worker binds the port with `SO_REUSEPORT` (the supervisor holds it reserved, bound
but not listening, from start to stop), so the kernel spreads calls over the workers as the
shared HTTP socket does. Inference goes through `batchserve.api.grpc.door` into the exchange
HTTP uses; every other RPC answers what its HTTP route answers, from the same functions.
Requests and answers of the inference RPCs stay bytes until the door decodes them, so a call
is parsed once, timed, and refused by its model before its tensors are read.

Why `grpc.aio` on the worker's loop, with grpcio's default options: the exchange runs on that
loop, and no other way grpcio offers costs less CPU a call (`benchmarks.grpc_variants`
measures them side by side): the sync `grpc.server` handing calls into the loop, protobuf's
(de)serializers, registered methods, and options that turn off channelz, BDP pings or cap
streams all cost the same within a run's noise. `grpc.minimal_stack` would drop the limit on
a message's size (`api.max_body_bytes`), so it is not an option here.

Health: the empty service name (or `inference.GRPCInferenceService`) is the server, ready as
`GET /v2/health/ready` is; a model's name is that model, ready as its `/ready` route is; any
other name is NOT_FOUND. A draining worker is NOT_SERVING.

Drain (`GrpcServer.stop`, on the worker's stop signal): the server stops taking new calls
(GOAWAY) and lets the calls it holds finish within the worker's drain grace, after which the
worker answers what is left UNAVAILABLE (`Service.abandon`) and gRPC cancels the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final

import grpc
import orjson
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from ...runner.metrics import registry
from .. import protocol, statistics, triton
from ..errors import BadRequest, BatchserveError
from ..service import Service
from .codec import read_request
from .door import CODE, GrpcExchange, message_of, refusal_of, status_of, trailers_of
from .messages import SERVICE, message

__all__ = ["GrpcServer", "Health", "InferenceService"]

log = logging.getLogger("batchserve.api.grpc")

Answer = tuple[int, bytes, Mapping[str, str]]

_UNSUPPORTED: Final = {
    "RepositoryModelLoad": "load", "RepositoryModelUnload": "load",
    "SystemSharedMemoryStatus": "systemsharedmemory",
    "SystemSharedMemoryRegister": "systemsharedmemory",
    "SystemSharedMemoryUnregister": "systemsharedmemory",
    "CudaSharedMemoryStatus": "cudasharedmemory",
    "CudaSharedMemoryRegister": "cudasharedmemory",
    "CudaSharedMemoryUnregister": "cudasharedmemory",
    "TraceSetting": "trace", "LogSettings": "logging",
}
"""Triton's extensions batchserve does not offer, each UNIMPLEMENTED with HTTP's 501 words."""


def _stream_answer(status: int, content: bytes, headers: Mapping[str, str], model: str,
                   ident: str) -> bytes:
    """A `ModelStreamInferResponse`: the answer in `infer_response`, or its error in
    `error_message` beside an `infer_response` that names the request's id."""
    if status == 200:
        # A message is the concatenation of its fields: field 2, length-delimited, is the
        # ModelInferResponse the exchange has serialized already.
        return b"\x12" + _varint(len(content)) + content
    answer = message("ModelStreamInferResponse")(error_message=content.decode())
    answer.infer_response.model_name = model
    answer.infer_response.id = ident
    data: bytes = answer.SerializeToString()
    return data


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if not isinstance(exc, BatchserveError):
        log.error("unexpected error answering a gRPC call", exc_info=exc)
    await context.abort(status_of(exc), message_of(exc), tuple(trailers_of(exc).items()))


class InferenceService:
    """The RPCs of `inference.GRPCInferenceService` over one worker's `Service`."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def handler(self) -> grpc.GenericRpcHandler:
        unary: dict[str, Callable[..., Awaitable[Any]]] = {
            "ServerLive": self.server_live, "ServerReady": self.server_ready,
            "ModelReady": self.model_ready, "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata, "ModelConfig": self.model_config,
            "ModelStatistics": self.model_statistics,
            "RepositoryIndex": self.repository_index,
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                _guarded(call), request_deserializer=message(f"{name}Request").FromString,
                response_serializer=_serialize)
            for name, call in unary.items()
        }
        for name, extension in _UNSUPPORTED.items():
            handlers[name] = grpc.unary_unary_rpc_method_handler(_refuse(extension))
        # Inference stays bytes both ways: the door decodes and encodes (see the docstring).
        handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(self.model_infer)
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self.model_stream_infer)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # --- health and metadata, as their HTTP routes ----------------------------------------

    async def server_live(self, request: Any, context: Any) -> Any:
        return message("ServerLiveResponse")(live=True)

    async def server_ready(self, request: Any, context: Any) -> Any:
        return message("ServerReadyResponse")(ready=self.service.ready)

    async def model_ready(self, request: Any, context: Any) -> Any:
        runner = self.service.runner(request.name, request.version or None)
        return message("ModelReadyResponse")(ready=self.service.model_ready(runner.name))

    async def server_metadata(self, request: Any, context: Any) -> Any:
        return _parse("ServerMetadataResponse", protocol.server_metadata())

    async def model_metadata(self, request: Any, context: Any) -> Any:
        runner = self.service.runner(request.name, request.version or None)
        ensemble = runner.name in self.service.config.pipelines
        return _parse("ModelMetadataResponse", protocol.model_metadata(runner, ensemble))

    async def model_config(self, request: Any, context: Any) -> Any:
        runner = self.service.runner(request.name, request.version or None)
        answer = message("ModelConfigResponse")()
        pipeline = self.service.config.pipelines.get(runner.name)
        document = (triton.config_document(runner) if pipeline is None
                    else triton.ensemble_document(pipeline))
        json_format.ParseDict(document, answer.config)
        return answer

    async def model_statistics(self, request: Any, context: Any) -> Any:
        names = ([self.service.runner(request.name, request.version or None).name]
                 if request.name else list(self.service.models))
        return _parse("ModelStatisticsResponse", statistics.encode(names, registry()))

    async def repository_index(self, request: Any, context: Any) -> Any:
        service = self.service
        unready = {name: ("the server is stopping" if service.stopping else
                          None if service.model_ready(name)
                          else "no process of its runner is connected")
                   for name in service.models}
        body = b'{"ready":true}' if request.ready else b""
        index = orjson.loads(triton.repository_index(unready, body))
        return json_format.ParseDict({"models": index}, message("RepositoryIndexResponse")())

    # --- inference --------------------------------------------------------------------------

    def _start(self, body: bytes, deadline: float | None, respond: Callable[[Answer], None]
               ) -> tuple[str, str]:
        """Admit and send one inference request; its answer comes to `respond`. The model
        and id, as far as they could be read."""
        try:
            request = read_request(body)
        except BadRequest as exc:
            respond(refusal_of(exc))
            return "", ""
        name, ident = request.model_name, request.id
        exchange = self.service.admit(GrpcExchange(
            self.service, name, lambda *answer: respond(answer), deadline, request),
            request.model_version or None)
        if not exchange.done:
            exchange.run(body, None)
        return name, ident

    async def model_infer(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        answered: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()

        def respond(answer: Answer) -> None:
            if not answered.done():  # a call its client cancelled is answered to nobody
                answered.set_result(answer)

        self._start(body, context.time_remaining(), respond)
        status, content, headers = await answered
        if status == 200:
            return content
        trailers = dict(headers)
        code = grpc.StatusCode[trailers.pop(CODE)]
        await context.abort(code, content.decode(), tuple(trailers.items()))
        raise AssertionError("abort raises")  # pragma: no cover

    async def model_stream_infer(self, requests: AsyncIterator[bytes],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Each request as `ModelInfer` takes it, answered in the order answers come, each
        with its request's id; an error is an answer (`error_message`) and the stream goes
        on. It ends once the client has closed its side and every answer is written."""
        answers: asyncio.Queue[bytes | None] = asyncio.Queue()
        open_ = [0]  # requests unanswered, and the reader's own share until it is done

        def read_one(body: bytes) -> None:
            where: list[str] = ["", ""]

            def respond(answer: Answer) -> None:
                answers.put_nowait(_stream_answer(*answer, where[0], where[1]))
                _settle()

            open_[0] += 1
            where[:] = self._start(body, context.time_remaining(), respond)

        def _settle() -> None:
            open_[0] -= 1
            if open_[0] == 0:
                answers.put_nowait(None)

        async def read_all() -> None:
            open_[0] += 1
            try:
                async for body in requests:
                    read_one(body)
            finally:
                _settle()

        reader = asyncio.create_task(read_all())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            reader.cancel()


def _serialize(answer: Any) -> bytes:
    data: bytes = answer.SerializeToString()
    return data


def _parse(name: str, document: bytes) -> Any:
    return json_format.Parse(document, message(name)(), ignore_unknown_fields=True)


def _guarded(call: Callable[[Any, Any], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A route's errors as gRPC statuses (an unknown model NOT_FOUND, ...)."""
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await call(request, context)
        except Exception as exc:
            await _abort(context, exc)
    return guarded


def _refuse(extension: str) -> Callable[..., Awaitable[Any]]:
    async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await _abort(context, triton.unsupported(extension))
        raise AssertionError("abort raises")  # pragma: no cover
    return refuse


class Health(health_aio.HealthServicer):  # type: ignore[misc]
    """`grpc.health.v1.Health` over the service's readiness (see the module docstring):
    `Check` reads it live; `Watch` is told of every change (`refresh`, a `Service` listener)."""

    def __init__(self, service: Service) -> None:
        super().__init__()
        self.service = service
        self.refresh()

    def status(self, name: str) -> Any:
        service = self.service
        if name in ("", SERVICE):
            up = service.ready
        elif name in service.models:
            up = service.model_ready(name)
        else:
            return None
        return health_pb2.HealthCheckResponse.SERVING if up else (
            health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no service or model {request.service!r} is served here")
        return health_pb2.HealthCheckResponse(status=status)

    def refresh(self) -> None:
        """Bring the statuses `Watch` reports up to date (from sync code: set is async)."""
        names = ["", SERVICE, *self.service.models]
        changed = {name: status for name in names
                   if (status := self.status(name)) != self._server_status.get(name)}
        if not changed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # at construction, before the loop: no watcher yet
            self._server_status.update(changed)
            return
        for name, status in changed.items():
            loop.create_task(self._set(name, status))


class GrpcServer:
    """One worker's gRPC server: started with the worker, stopped with its drain."""

    def __init__(self, service: Service, host: str, port: int) -> None:
        self.service = service
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.server: grpc.aio.Server | None = None
        self.stopped: asyncio.Task[None] | None = None

    async def start(self) -> None:
        limit = self.service.config.api.max_body_bytes
        server = self.server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", -1),
        ])
        server.add_generic_rpc_handlers((InferenceService(self.service).handler(),))
        health = Health(self.service)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        self.service.listeners.append(health.refresh)
        if server.add_insecure_port(self.address) == 0:
            raise OSError(f"cannot listen for gRPC on {self.address}")
        await server.start()

    def stop(self, grace_s: float) -> None:
        """Stop taking calls now (GOAWAY); those held get `grace_s` to finish."""
        if self.server is not None and self.stopped is None:
            self.stopped = asyncio.get_running_loop().create_task(self.server.stop(grace_s))

    async def wait_stopped(self) -> None:
        if self.server is not None:
            if self.stopped is None:
                self.stop(0)
            assert self.stopped is not None
            await self.stopped
