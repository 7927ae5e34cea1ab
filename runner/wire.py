"""The API-to-runner wire: length-prefixed frames carrying tensors as raw bytes.

Nothing is pickled: a frame is a small fixed header, per-tensor headers and the tensors' own
bytes, so either side can be written in any language and the bytes go from the socket to
numpy without a per-element step. The format does not care what carries it: `Address`
names a unix socket today and a TCP endpoint when runners move to other hosts.

    frame   := u32 body_length | body
    body    := u8 kind | u64 id | payload
    Call    := f64 budget_s | u32 rows | u16 count | tensor*  (API -> runner)
    Result  := u16 count | tensor*                                  (runner -> API)
    Failure := u8 code | f64 retry_after_s | utf-8 text             (runner -> API)
    Started := u32 count | u64 call_ids[count]                      (runner -> API; id 0)
    Ping, Pong := (empty)
    tensor  := u8 name_len | name | u8 dtype | u8 ndim | i64 dims[ndim] | pad to 8 | data

Tensor data starts 8-byte aligned within the body so numpy and torch can view it in place.
"""

from __future__ import annotations

import asyncio
import enum
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchserve.runner.types import DATATYPES, Tensors

_LENGTH = struct.Struct("<I")
_HEAD = struct.Struct("<BQ")
_CALL = struct.Struct("<dIH")
_COUNT = struct.Struct("<H")
_FAILURE = struct.Struct("<Bd")
_STARTED = struct.Struct("<I")
_DTYPES = list(DATATYPES.values())
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
MAX_FRAME = 1 << 31


class WireError(ValueError):
    """A frame that does not follow the format: the connection cannot be trusted further."""


class Kind(enum.IntEnum):
    CALL = 1
    RESULT = 2
    FAILURE = 3
    PING = 4
    PONG = 5
    STARTED = 6


class FailureCode(enum.IntEnum):
    """Why a runner did not answer a call with tensors; the API maps each to a status."""

    INVALID = 1  # the tensors do not match the runner's signature
    REFUSED = 2  # the deadline cannot be met: refused at arrival
    EXPIRED = 3  # the deadline passed while the request was queued
    MODEL_ERROR = 4  # the model raised
    STOPPING = 5  # the runner is shutting down
    TIMEOUT = 6  # the model call ran past the runner's batch_timeout_ms
    TOO_LARGE = 7  # too many rows to meet the limit even on an idle model




@dataclass(frozen=True, slots=True)
class Call:
    """Run `tensors`, `rows` along the input batch dimension, within `budget_s` seconds.

    The sender counted the rows when it checked the tensors; the runner checks that they
    agree instead of counting again wherever it needs them.
    """

    id: int
    budget_s: float
    rows: int
    tensors: Tensors


@dataclass(frozen=True, slots=True)
class Result:
    id: int
    tensors: Tensors


@dataclass(frozen=True, slots=True)
class Failure:
    id: int
    code: FailureCode
    message: str
    retry_after_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Started:
    """These calls' batches went to the model: a call not named here had not started when a
    connection drops, so its caller may send it to another process of the runner."""

    calls: tuple[int, ...]
    id: int = 0


@dataclass(frozen=True, slots=True)
class Ping:
    id: int


@dataclass(frozen=True, slots=True)
class Pong:
    id: int


Message = Call | Result | Failure | Started | Ping | Pong
Chunks = list[bytes | memoryview]


# --- encoding ---------------------------------------------------------------------------------


def _tensor_chunks(name: str, array: np.ndarray, offset: int, out: Chunks) -> int:
    """Append one tensor's header, padding and data; return the new body offset."""
    code = _DTYPE_CODES.get(array.dtype)
    if code is None:
        raise WireError(f"tensor {name!r} has dtype {array.dtype}, which the wire cannot carry")
    encoded = name.encode()
    header = struct.pack(f"<B{len(encoded)}sBB{array.ndim}q", len(encoded), encoded, code,
                         array.ndim, *array.shape)
    offset += len(header)
    pad = -offset % 8
    out.append(header + b"\0" * pad)
    offset += pad
    data = np.ascontiguousarray(array)
    out.append(memoryview(data).cast("B"))  # type: ignore[arg-type]
    return offset + data.nbytes


def _tensors_chunks(tensors: Tensors, offset: int, out: Chunks) -> None:
    for name, array in tensors.items():
        offset = _tensor_chunks(name, array, offset, out)


def encode(message: Message) -> Chunks:
    """A message as a list of buffers for `transport.writelines`, tensor data uncopied."""
    out: Chunks = [b""]  # replaced by the length prefix and head
    if isinstance(message, Call):
        head = _HEAD.pack(Kind.CALL, message.id) + _CALL.pack(
            message.budget_s, message.rows, len(message.tensors))
        _tensors_chunks(message.tensors, len(head), out)
    elif isinstance(message, Result):
        head = _HEAD.pack(Kind.RESULT, message.id) + _COUNT.pack(len(message.tensors))
        _tensors_chunks(message.tensors, len(head), out)
    elif isinstance(message, Failure):
        head = _HEAD.pack(Kind.FAILURE, message.id) + _FAILURE.pack(
            message.code, message.retry_after_s) + message.message.encode()
    elif isinstance(message, Started):
        calls = message.calls
        head = _HEAD.pack(Kind.STARTED, message.id) + struct.pack(f"<I{len(calls)}Q", len(calls),
                                                                   *calls)
    else:
        head = _HEAD.pack(Kind.PING if isinstance(message, Ping) else Kind.PONG, message.id)
    size = len(head) + sum(len(chunk) for chunk in out[1:])
    if size >= MAX_FRAME:
        raise WireError(f"a frame of {size} bytes exceeds the wire's limit of {MAX_FRAME}")
    out[0] = _LENGTH.pack(size) + head
    return out


# --- decoding ---------------------------------------------------------------------------------


def _read_tensors(body: bytearray, offset: int, count: int) -> Tensors:
    tensors: Tensors = {}
    view = memoryview(body)
    for _ in range(count):
        name_len = body[offset]
        name = bytes(body[offset + 1 : offset + 1 + name_len]).decode()
        offset += 1 + name_len
        code, ndim = body[offset], body[offset + 1]
        offset += 2
        if code >= len(_DTYPES):
            raise WireError(f"tensor {name!r} has unknown dtype code {code}")
        shape = struct.unpack_from(f"<{ndim}q", body, offset)
        offset += 8 * ndim
        offset += -offset % 8
        dtype = _DTYPES[code]
        count_items = math.prod(shape)
        end = offset + count_items * dtype.itemsize
        if min(shape, default=0) < 0 or end > len(body):
            raise WireError(f"tensor {name!r} with shape {list(shape)} overruns its frame")
        tensors[name] = np.frombuffer(view[offset:end], dtype=dtype).reshape(shape)
        offset = end
    return tensors


def decode(body: bytearray) -> Message:
    """One frame body as a message; tensors are writable views into `body`."""
    try:
        kind, ident = _HEAD.unpack_from(body, 0)
        offset = _HEAD.size
        if kind == Kind.CALL:
            budget, rows, count = _CALL.unpack_from(body, offset)
            return Call(ident, budget, rows, _read_tensors(body, offset + _CALL.size, count))
        if kind == Kind.RESULT:
            (count,) = _COUNT.unpack_from(body, offset)
            return Result(ident, _read_tensors(body, offset + _COUNT.size, count))
        if kind == Kind.FAILURE:
            code, retry = _FAILURE.unpack_from(body, offset)
            text = bytes(body[offset + _FAILURE.size :]).decode(errors="replace")
            return Failure(ident, FailureCode(code), text, retry)
        if kind == Kind.STARTED:
            (count,) = _STARTED.unpack_from(body, offset)
            calls = struct.unpack_from(f"<{count}Q", body, offset + _STARTED.size)
            return Started(calls, ident)
        if kind == Kind.PING:
            return Ping(ident)
        if kind == Kind.PONG:
            return Pong(ident)
    except (struct.error, IndexError, ValueError) as exc:
        raise WireError(f"malformed frame: {exc}") from None
    raise WireError(f"unknown frame kind {kind}")


STAGE_BYTES = 1 << 16
"""Bytes read at most per read while no frame is being filled in place."""


class FrameReader:
    """Cuts a byte stream into frame bodies, copying each byte once at most.

    Reads land in a staging buffer, where many small frames fit at once and each is copied
    out as its own body. A frame that runs past what is staged gets its body allocated at
    its full length, and the reads after go straight into it: a large tensor passes from
    the socket to numpy with no copy but the kernel's. The interface is that of
    `asyncio.BufferedProtocol` (`get_buffer`, then `buffer_updated`); `feed` serves
    callers that hold bytes already.
    """

    def __init__(self) -> None:
        self._stage = bytearray(STAGE_BYTES)
        self._staged = 0  # bytes of the stage not yet cut: always a frame's start
        self._body: bytearray | None = None  # the frame being filled in place
        self._filled = 0

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._filled :]
        return memoryview(self._stage)[self._staged :]

    def buffer_updated(self, nbytes: int) -> list[bytearray]:
        """The bodies that the `nbytes` just written into `get_buffer()` completed."""
        body = self._body
        if body is None:
            self._staged += nbytes
            return self._cut()
        self._filled += nbytes
        if self._filled < len(body):
            return []
        self._body = None
        return [body]

    def feed(self, data: bytes) -> list[bytearray]:
        bodies: list[bytearray] = []
        view = memoryview(data)
        while view:
            buffer = self.get_buffer()
            count = min(len(buffer), len(view))
            buffer[:count] = view[:count]
            bodies += self.buffer_updated(count)
            view = view[count:]
        return bodies

    def _cut(self) -> list[bytearray]:
        stage, staged = self._stage, self._staged
        bodies: list[bytearray] = []
        start = 0
        while staged - start >= 4:
            (size,) = _LENGTH.unpack_from(stage, start)
            if size >= MAX_FRAME:
                raise WireError(f"a frame announces {size} bytes, over the wire's limit")
            begin, end = start + 4, start + 4 + size
            if end <= staged:
                bodies.append(stage[begin:end])
                start = end
                continue
            body = bytearray(size)
            body[: staged - begin] = memoryview(stage)[begin:staged]
            self._body, self._filled = body, staged - begin
            start = staged
        # Fewer than four bytes are left (part of a length): they move to the stage's start.
        stage[: staged - start] = stage[start:staged]
        self._staged = staged - start
        return bodies


class Outbox:
    """Messages for one transport, written together once per event-loop turn.

    A batch answers all its requests at once and a busy API worker sends many calls in
    one turn: gathering them turns N write system calls into one.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._chunks: Chunks = []

    def put(self, message: Message) -> None:
        if not self._chunks:
            asyncio.get_running_loop().call_soon(self._flush)
        self._chunks.extend(encode(message))

    def _flush(self) -> None:
        chunks, self._chunks = self._chunks, []
        if not self.transport.is_closing():
            self.transport.writelines(chunks)


# --- addresses --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Address:
    """Where a runner listens: `unix:/path/to.sock` or `tcp:host:port`."""

    scheme: str
    target: str

    @classmethod
    def parse(cls, text: str) -> Address:
        scheme, sep, target = text.partition(":")
        if not sep or scheme not in ("unix", "tcp") or not target:
            raise ValueError(f"address {text!r} must look like unix:/path or tcp:host:port")
        if scheme == "tcp":
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"address {text!r} must look like tcp:host:port")
        return cls(scheme, target)

    def __str__(self) -> str:
        return f"{self.scheme}:{self.target}"

    def _host_port(self) -> tuple[str, int]:
        host, _, port = self.target.rpartition(":")
        return host, int(port)

    async def serve(self, factory: Callable[[], asyncio.BaseProtocol]) -> asyncio.Server:
        loop = asyncio.get_running_loop()
        if self.scheme == "unix":
            return await loop.create_unix_server(factory, self.target)
        host, port = self._host_port()
        return await loop.create_server(factory, host, port)

    async def connect(self, factory: Callable[[], Any]) -> tuple[asyncio.Transport, Any]:
        loop = asyncio.get_running_loop()
        if self.scheme == "unix":
            return await loop.create_unix_connection(factory, self.target)  # type: ignore
        host, port = self._host_port()
        return await loop.create_connection(factory, host, port)  # type: ignore
