"""The API-to-runner wire: length-prefixed frames carrying tensors as raw bytes.

Nothing is pickled: a frame is a small fixed header, per-tensor headers and the tensors' own
bytes, so either side can be written in any language and the bytes go from the socket to
numpy without a per-element step. The format does not care what carries it: `Address`
names a unix socket or a TCP endpoint (optionally under TLS) on another host.

    frame   := u32 body_length | body
    body    := u8 kind | u64 id | payload
    Call    := f64 budget_s | f64 spent_s | f64 front_s | f64 sent_s | u32 rows | u16 count
               | u8 groups
               | (u16 length | utf-8)[groups]
               | tensor*                                         (API -> runner)
    Result  := f64 spare_s | u16 count | tensor*                    (runner -> API)
    Results := u32 answers | u8 dim | u16 count | u64 ids[answers] | f64 spare_s[answers]
               | i64 lengths[count][answers] | tensor*               (runner -> API; id 0)
    Failure := u8 code | f64 retry_after_s | f64 predicted_s | f64 deadline_s
               | u32 rows_ahead | utf-8 text                       (runner -> API)
    Started := u32 count | u64 call_ids[count]                      (runner -> API; id 0)
    Backlog := f64 wait_s | f64 drain_s | f64 row_s | f64 request_rows | u32 rows_ahead
               | u32 next_rows                                      (runner -> API; id 0)
    Ping, Pong := (empty)
    Hello   := u16 version | u32 max_batch_size | u8 name_len | name | nonce[32]
               | u8 proof_len | proof                  (both ways, first; id 0)
    Welcome := u8 proof_len | proof                    (runner -> API, after Hello; id 0)
    tensor  := u8 name_len | name | u8 dtype | u8 ndim | i64 dims[ndim] | pad to 8 | data
    data    := the elements' raw bytes, row-major, little-endian
             | u64 size | (u32 length | bytes)*     (BYTES: each element prefixed by its length)

Tensor data starts 8-byte aligned within the body so numpy and torch can view it in place.
BYTES elements are laid out as the v2 binary tensor extension lays them out, behind the
total size of that layout so a reader can bounds-check it before reading an element.

A connection opens with a handshake before any call (see `batchserve.runner.core.handshake`): the
runner sends a Hello, the API answers with its own, the runner accepts with a Welcome or refuses
with a Failure (code HANDSHAKE) and closes. A Hello's version comes first and is all that a peer
speaking another version is sure to read: a change to any frame changes `PROTOCOL_VERSION`.
"""

from __future__ import annotations

import asyncio
import enum
import math
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .types import BYTES, DATATYPES, Tensors

_LENGTH = struct.Struct("<I")
_HEAD = struct.Struct("<BQ")
_CALL = struct.Struct("<ddddIHB")
_GROUP_VALUE = struct.Struct("<H")
_RESULT = struct.Struct("<dH")
_RESULTS = struct.Struct("<IBH")
_FAILURE = struct.Struct("<BdddI")
_STARTED = struct.Struct("<I")
_BACKLOG = struct.Struct("<ddddII")
_SIZE = struct.Struct("<Q")
_ELEMENT = struct.Struct("<I")
_HELLO = struct.Struct("<HI")
_VERSION = struct.Struct("<H")
NONCE_BYTES = 32
# 2: the Call frame carries its row count; 3: and its group; 4: and its spent time;
# 5: a Failure carries the prediction a refusal was made on; 6: a Call carries its API
# worker's cost; 7: a Call carries when it was sent, and a runner publishes its Backlog;
# 8: a Result carries how long before its deadline its batch ended; 9: a Backlog carries
# how many rows the next batch takes; 10: a batch's answers to one connection go in one
# Results frame
PROTOCOL_VERSION = 10
_DTYPES = list(DATATYPES.values())
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
MAX_FRAME = 1 << 31


# A request's own messages (Call, Result, Failure) are read-only by convention, not frozen:
# a frozen dataclass sets each field through object.__setattr__, five times the cost of a
# plain one, and a request makes one of each kind it meets on both sides of the wire.


class WireError(ValueError):
    """A frame that does not follow the format: the connection cannot be trusted further."""


class Kind(enum.IntEnum):
    CALL = 1
    RESULT = 2
    FAILURE = 3
    PING = 4
    PONG = 5
    STARTED = 6
    HELLO = 7
    WELCOME = 8
    BACKLOG = 9
    RESULTS = 10


class FailureCode(enum.IntEnum):
    """Why a runner did not answer a call with tensors; the API maps each to a status."""

    INVALID = 1  # the tensors do not match the runner's signature
    REFUSED = 2  # the deadline cannot be met: refused at arrival
    EXPIRED = 3  # the deadline passed while the request was queued
    MODEL_ERROR = 4  # the model raised
    STOPPING = 5  # the runner is shutting down
    TIMEOUT = 6  # the model call ran past the runner's batch_timeout_ms
    TOO_LARGE = 7  # too many rows to meet the limit even on an idle model
    HANDSHAKE = 8  # the connection's Hello was refused (version, runner name or token)




@dataclass(slots=True)
class Call:
    """Run `tensors`, `rows` along the input batch dimension (1 for a request of ragged or
    pad inputs: one sequence), within `budget_s` seconds.

    The sender counted the rows when it checked the tensors; the runner checks that they
    agree instead of counting again wherever it needs them.
    """

    id: int
    budget_s: float
    rows: int
    tensors: Tensors
    group: tuple[str, ...] = ()
    """The request's values of the runner's `group_by` parameters, as JSON texts."""
    spent_s: float = 0.0
    """What the request cost before it was sent (the API's CPU time decoding it), which it
    costs again however often it is sent: part of what must fit the latency limit."""
    front_s: float = 0.0
    """What its API worker spends on a request lately, in CPU seconds (decoding, dispatch,
    the answer): what the runner's capacity must count beside its own."""
    sent_s: float = 0.0
    """When the call was sent, on the sender's monotonic clock (0: unknown). A runner on
    the same machine shares that clock, so a call it reads late (it reads while its model is
    free, see `batchserve.runner.server`) keeps the deadline it was sent with."""


@dataclass(slots=True)
class Result:
    """A call's outputs, and how long before the call's deadline its batch ended (`spare_s`,
    on the runner's clock; negative: after). The caller adds how late past its own deadline
    the answer left it: the sum is the answer's way home, whoever's clock is ahead."""

    id: int
    tensors: Tensors
    spare_s: float


@dataclass(frozen=True, slots=True)
class Results:
    """The answers of one batch to one connection, in one frame: each answer's part of every
    output, one after another along the output batch dimension `dim`, `lengths[t][a]` long
    in tensor `t` for answer `a`. A batch's answers are framed, written and read once, not
    once each (`batched` makes one); `answers` cuts it back into Results, views, not copies.
    """

    ids: tuple[int, ...]
    spares: tuple[float, ...]
    lengths: tuple[tuple[int, ...], ...]
    dim: int
    tensors: Tensors
    id: int = 0

    def answers(self) -> list[Result]:
        lead = (slice(None),) * self.dim
        found = [Result(ident, {}, spare)
                 for ident, spare in zip(self.ids, self.spares, strict=True)]
        for (name, array), lengths in zip(self.tensors.items(), self.lengths, strict=True):
            end = 0
            for result, length in zip(found, lengths, strict=True):
                result.tensors[name] = array[(*lead, slice(end, end + length))]
                end += length
        return found


def batched(results: list[Result], dim: int) -> list[Result | Results]:
    """Answers to one connection as few frames as can carry them: one `Results` when every
    answer has the same outputs, of the same dtypes and shapes but along `dim` (a batch's
    answers, split from its outputs); else each in its own frame."""
    if len(results) < 2:
        return list(results)
    first = results[0].tensors
    lengths: list[tuple[int, ...]] = []
    for name, array in first.items():
        if array.ndim <= dim:
            return list(results)
        rest = array.shape[:dim] + array.shape[dim + 1:]
        along = []
        for result in results:
            other = result.tensors.get(name)
            if (other is None or len(result.tensors) != len(first) or other.dtype != array.dtype
                    or other.shape[:dim] + other.shape[dim + 1:] != rest
                    or other.ndim != array.ndim):
                return list(results)
            along.append(other.shape[dim])
        lengths.append(tuple(along))
    tensors = {name: np.concatenate([result.tensors[name] for result in results], axis=dim)
               for name in first}
    return [Results(tuple(result.id for result in results),
                    tuple(result.spare_s for result in results), tuple(lengths), dim, tensors)]


@dataclass(slots=True)
class Failure:
    """A call answered without tensors, and when to try again (`retry_after_s`: for a
    refusal, the time the runner's backlog needs, see `batchserve.runner.core.retry`). A
    refusal (REFUSED) also says what it was judged on: when the call was predicted to finish
    and its deadline, both in seconds after it reached the runner, and the rows ahead of it;
    zero otherwise."""

    id: int
    code: FailureCode
    message: str
    retry_after_s: float = 0.0
    predicted_s: float = 0.0
    deadline_s: float = 0.0
    rows_ahead: int = 0


@dataclass(frozen=True, slots=True)
class Started:
    """These calls' batches went to the model: a call not named here had not started when a
    connection drops, so its caller may send it to another process of the runner."""

    calls: tuple[int, ...]
    id: int = 0


@dataclass(frozen=True, slots=True)
class Backlog:
    """What a runner publishes with its answers, so an API worker can refuse in place what the
    runner would refuse: `wait_s`, how long a one-row request arriving now is predicted to
    take (at the high quantile the runner admits on), or 0 when the runner refuses nothing
    on arrival, and the rows it would find ahead. It ages by the time since it was heard:
    the backlog drains. A refusal's Retry-After covers `drain_s`, the time the rows ahead
    and those the runner refused lately need, and `row_s` for each row refused since; a
    request refused before its rows are known counts `request_rows`, a request's lately.
    `next_rows` is how many rows the next batch takes at most, as the policy caps it now (0
    where it does not say): rows sent beyond it wait for a batch after."""

    wait_s: float
    rows_ahead: int = 0
    drain_s: float = 0.0
    row_s: float = 0.0
    request_rows: float = 1.0
    next_rows: int = 0
    id: int = 0


@dataclass(frozen=True, slots=True)
class Ping:
    id: int


@dataclass(frozen=True, slots=True)
class Pong:
    id: int


@dataclass(frozen=True, slots=True)
class Hello:
    """The first frame each way: who speaks, what it speaks, and a fresh nonce; the API's
    also carries its proof of the shared token (empty without one)."""

    version: int
    runner: str
    max_batch_size: int
    nonce: bytes
    proof: bytes = b""
    id: int = 0


@dataclass(frozen=True, slots=True)
class Welcome:
    """The runner accepts the API's Hello; `proof` shows it holds the token too."""

    proof: bytes = b""
    id: int = 0


Message = (Call | Result | Results | Failure | Started | Backlog | Ping | Pong | Hello
           | Welcome)
Chunks = list[bytes | memoryview]


# --- encoding ---------------------------------------------------------------------------------


_Header = tuple[bytes, struct.Struct]
_HEADERS: dict[tuple[str, np.dtype[Any], int], _Header] = {}
"""A tensor header's fixed part (name, dtype, rank) and the packer of its shape, by what
makes it: a runner's few inputs and outputs come again in every frame."""
_SHAPES = [struct.Struct(f"<{ndim}q") for ndim in range(256)]


def _header(name: str, dtype: np.dtype[Any], ndim: int) -> _Header:
    key = (name, dtype, ndim)
    header = _HEADERS.get(key)
    if header is None:
        code = _DTYPE_CODES.get(dtype)
        if code is None:
            raise WireError(f"tensor {name!r} has dtype {dtype}, which the wire cannot carry")
        encoded = name.encode()
        if len(encoded) > 255:
            raise WireError(f"tensor name {name!r} is over 255 bytes")
        header = (bytes([len(encoded)]) + encoded + bytes([code, ndim]), _SHAPES[ndim])
        if len(_HEADERS) < 4096:  # names come from signatures: few, unless a peer invents them
            _HEADERS[key] = header
    return header


def _tensor_chunks(name: str, array: np.ndarray, offset: int, out: Chunks) -> int:
    """Append one tensor's header, padding and data; return the new body offset."""
    fixed, shape = _header(name, array.dtype, array.ndim)
    offset += len(fixed) + shape.size
    pad = -offset % 8
    out.append(fixed + shape.pack(*array.shape) + _PADS[pad])
    offset += pad
    if array.dtype == BYTES:
        return offset + _bytes_chunks(name, array, out)
    data = np.ascontiguousarray(array)
    out.append(memoryview(data).cast("B"))  # type: ignore[arg-type]
    return offset + data.nbytes


_PADS = [b"\0" * pad for pad in range(8)]


def _bytes_chunks(name: str, array: np.ndarray, out: Chunks) -> int:
    """Append a BYTES tensor's size and length-prefixed elements; return their byte count."""
    parts: list[bytes] = []
    for item in array.flat:
        if type(item) is not bytes:
            raise WireError(f"tensor {name!r} is BYTES but holds a {type(item).__name__}")
        parts += (_ELEMENT.pack(len(item)), item)
    data = b"".join(parts)
    out.append(_SIZE.pack(len(data)) + data)
    return _SIZE.size + len(data)


def _tensors_chunks(tensors: Tensors, offset: int, out: Chunks) -> int:
    """Append every tensor after a head of `offset` bytes; return the body's size."""
    for name, array in tensors.items():
        offset = _tensor_chunks(name, array, offset, out)
    return offset


def encode(message: Message) -> Chunks:
    """A message as a list of buffers for `transport.writelines`, tensor data uncopied."""
    out: Chunks = [b""]  # replaced by the length prefix and head
    if isinstance(message, Call):
        head = _HEAD.pack(Kind.CALL, message.id) + _CALL.pack(
            message.budget_s, message.spent_s, message.front_s, message.sent_s, message.rows,
            len(message.tensors), len(message.group)
        ) + _group_bytes(message.group)
        size = _tensors_chunks(message.tensors, len(head), out)
    elif isinstance(message, Result):
        head = _HEAD.pack(Kind.RESULT, message.id) + _RESULT.pack(
            message.spare_s, len(message.tensors))
        size = _tensors_chunks(message.tensors, len(head), out)
    elif isinstance(message, Results):
        count, tensors = len(message.ids), len(message.tensors)
        head = _HEAD.pack(Kind.RESULTS, message.id) + _RESULTS.pack(
            count, message.dim, tensors) + struct.pack(
            f"<{count}Q{count}d{count * tensors}q", *message.ids, *message.spares,
            *(length for lengths in message.lengths for length in lengths))
        size = _tensors_chunks(message.tensors, len(head), out)
    else:
        head = _plain_head(message)
        size = len(head)
    if size >= MAX_FRAME:
        raise WireError(f"a frame of {size} bytes exceeds the wire's limit of {MAX_FRAME}")
    out[0] = _LENGTH.pack(size) + head
    return out


def _plain_head(message: Message) -> bytes:
    """The whole body of a message that carries no tensors."""
    if isinstance(message, Failure):
        return _HEAD.pack(Kind.FAILURE, message.id) + _FAILURE.pack(
            message.code, message.retry_after_s, message.predicted_s, message.deadline_s,
            message.rows_ahead) + message.message.encode()
    if isinstance(message, Started):
        calls = message.calls
        return _HEAD.pack(Kind.STARTED, message.id) + struct.pack(
            f"<I{len(calls)}Q", len(calls), *calls)
    if isinstance(message, Backlog):
        return _HEAD.pack(Kind.BACKLOG, message.id) + _BACKLOG.pack(
            message.wait_s, message.drain_s, message.row_s, message.request_rows,
            message.rows_ahead, message.next_rows)
    if isinstance(message, Hello):
        return _HEAD.pack(Kind.HELLO, message.id) + _hello_bytes(message)
    if isinstance(message, Welcome):
        return _HEAD.pack(Kind.WELCOME, message.id) + _short(message.proof, "proof")
    return _HEAD.pack(Kind.PING if isinstance(message, Ping) else Kind.PONG, message.id)


def _group_bytes(group: tuple[str, ...]) -> bytes:
    if not group:
        return b""
    if len(group) > 255:
        raise WireError(f"a call's group of {len(group)} values is over 255")
    parts: list[bytes] = []
    for value in group:
        encoded = value.encode()
        if len(encoded) > 0xFFFF:
            raise WireError(f"a group value of {len(encoded)} bytes is over 65535")
        parts += (_GROUP_VALUE.pack(len(encoded)), encoded)
    return b"".join(parts)


def _read_group(body: bytearray, offset: int, count: int) -> tuple[tuple[str, ...], int]:
    if not count:
        return (), offset
    values = []
    for _ in range(count):
        (size,) = _GROUP_VALUE.unpack_from(body, offset)
        offset += _GROUP_VALUE.size
        if offset + size > len(body):
            raise WireError("a call's group value overruns its frame")
        values.append(bytes(body[offset : offset + size]).decode())
        offset += size
    return tuple(values), offset


def _short(data: bytes, what: str) -> bytes:
    if len(data) > 255:
        raise WireError(f"a Hello's {what} of {len(data)} bytes is over 255")
    return bytes([len(data)]) + data


def _hello_bytes(hello: Hello) -> bytes:
    if len(hello.nonce) != NONCE_BYTES:
        raise WireError(f"a Hello's nonce must be {NONCE_BYTES} bytes")
    return (_HELLO.pack(hello.version, hello.max_batch_size)
            + _short(hello.runner.encode(), "runner name") + hello.nonce
            + _short(hello.proof, "proof"))


def _read_short(body: bytearray, offset: int) -> tuple[bytes, int]:
    size = body[offset]
    end = offset + 1 + size
    if end > len(body):
        raise WireError("a Hello field overruns its frame")
    return bytes(body[offset + 1 : end]), end


def _read_hello(body: bytearray, offset: int) -> Hello:
    (version,) = _VERSION.unpack_from(body, offset)
    if version != PROTOCOL_VERSION:  # the rest may be laid out otherwise: not read
        return Hello(version, "", 0, b"")
    _, max_batch = _HELLO.unpack_from(body, offset)
    name, offset = _read_short(body, offset + _HELLO.size)
    nonce = bytes(body[offset : offset + NONCE_BYTES])
    if len(nonce) != NONCE_BYTES:
        raise WireError("a Hello's nonce overruns its frame")
    proof, _ = _read_short(body, offset + NONCE_BYTES)
    return Hello(version, name.decode(), max_batch, nonce, proof)


# --- decoding ---------------------------------------------------------------------------------


_NAMES: dict[bytes, str] = {}
"""Tensor names read from frames, decoded once."""


def _read_name(body: bytearray, offset: int) -> tuple[str, int]:
    end = offset + 1 + body[offset]
    raw = bytes(body[offset + 1 : end])
    name = _NAMES.get(raw)
    if name is None:
        name = raw.decode()
        if len(_NAMES) < 4096:
            _NAMES[raw] = name
    return name, end


def _read_tensors(body: bytearray, offset: int, count: int) -> Tensors:
    tensors: Tensors = {}
    view = memoryview(body)
    for _ in range(count):
        name, offset = _read_name(body, offset)
        code, ndim = body[offset], body[offset + 1]
        offset += 2
        if code >= len(_DTYPES):
            raise WireError(f"tensor {name!r} has unknown dtype code {code}")
        shape = _SHAPES[ndim].unpack_from(body, offset)
        offset += 8 * ndim
        offset += -offset % 8
        dtype = _DTYPES[code]
        if ndim and min(shape) < 0:
            raise WireError(f"tensor {name!r} has shape {list(shape)}")
        if dtype == BYTES:
            tensors[name], offset = _read_bytes(name, body, offset, shape)
            continue
        end = offset + math.prod(shape) * dtype.itemsize
        if end > len(body):
            raise WireError(f"tensor {name!r} with shape {list(shape)} overruns its frame")
        tensors[name] = np.frombuffer(view[offset:end], dtype=dtype).reshape(shape)
        offset = end
    return tensors


def _read_bytes(
    name: str, body: bytearray, offset: int, shape: tuple[int, ...]
) -> tuple[np.ndarray, int]:
    """A BYTES tensor (an object array of `bytes`) and the offset after it."""
    (size,) = _SIZE.unpack_from(body, offset)
    offset += _SIZE.size
    end = offset + size
    if end > len(body):
        raise WireError(f"tensor {name!r} of {size} bytes overruns its frame")
    array = np.empty(math.prod(shape), object)
    for i in range(array.size):
        if offset + _ELEMENT.size > end:
            raise WireError(f"tensor {name!r} has element {i} overrunning its data")
        (length,) = _ELEMENT.unpack_from(body, offset)
        start, offset = offset + _ELEMENT.size, offset + _ELEMENT.size + length
        if offset > end:
            raise WireError(f"tensor {name!r} has element {i} overrunning its data")
        array[i] = bytes(body[start:offset])
    if offset != end:
        raise WireError(f"tensor {name!r} has {end - offset} bytes after its elements")
    return array.reshape(shape), offset


def _read_results(body: bytearray, offset: int, ident: int) -> Results:
    answers, dim, count = _RESULTS.unpack_from(body, offset)
    offset += _RESULTS.size
    numbers = struct.unpack_from(f"<{answers}Q{answers}d{answers * count}q", body, offset)
    offset += 8 * len(numbers)
    lengths = tuple(tuple(numbers[2 * answers + t * answers: 2 * answers + (t + 1) * answers])
                    for t in range(count))
    tensors = _read_tensors(body, offset, count)
    for (name, array), along in zip(tensors.items(), lengths, strict=True):
        if array.ndim <= dim or min(along, default=0) < 0 or sum(along) != array.shape[dim]:
            raise WireError(f"tensor {name!r} with shape {list(array.shape)} does not hold "
                            f"answers of lengths {list(along)} along dimension {dim}")
    return Results(numbers[:answers], numbers[answers: 2 * answers], lengths, dim, tensors,
                   ident)


def decode(body: bytearray) -> Message:
    """One frame body as a message; tensors are writable views into `body`."""
    try:
        kind, ident = _HEAD.unpack_from(body, 0)
        offset = _HEAD.size
        if kind == Kind.CALL:
            budget, spent, front, sent, rows, count, groups = _CALL.unpack_from(body, offset)
            group, offset = _read_group(body, offset + _CALL.size, groups)
            return Call(ident, budget, rows, _read_tensors(body, offset, count), group, spent,
                        front, sent)
        if kind == Kind.RESULT:
            spare, count = _RESULT.unpack_from(body, offset)
            return Result(ident, _read_tensors(body, offset + _RESULT.size, count), spare)
        if kind == Kind.RESULTS:
            return _read_results(body, offset, ident)
        if kind == Kind.FAILURE:
            code, retry, predicted, deadline, ahead = _FAILURE.unpack_from(body, offset)
            text = bytes(body[offset + _FAILURE.size :]).decode(errors="replace")
            return Failure(ident, FailureCode(code), text, retry, predicted, deadline, ahead)
        if kind == Kind.STARTED:
            (count,) = _STARTED.unpack_from(body, offset)
            calls = struct.unpack_from(f"<{count}Q", body, offset + _STARTED.size)
            return Started(calls, ident)
        if kind == Kind.BACKLOG:
            wait, drain, row, request_rows, ahead, next_rows = _BACKLOG.unpack_from(body, offset)
            return Backlog(wait, ahead, drain, row, request_rows, next_rows, ident)
        if kind == Kind.PING:
            return Ping(ident)
        if kind == Kind.PONG:
            return Pong(ident)
        if kind == Kind.HELLO:
            return _read_hello(body, offset)
        if kind == Kind.WELCOME:
            return Welcome(_read_short(body, offset)[0], ident)
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

    @property
    def partial(self) -> bool:
        """Whether a frame has begun to arrive and not ended: the rest of it is on its way."""
        return self._body is not None or self._staged > 0

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
    one turn: gathering them turns N write system calls into one. `gather`, if given, is
    asked for the last messages just before each write (a runner's Started frame, which then
    leaves in the same write as the answers of the batch before, and its Backlog).
    """

    def __init__(self, transport: asyncio.Transport,
                 gather: Callable[[], list[Message]] | None = None) -> None:
        self.transport = transport
        self.gather = gather
        self._chunks: Chunks = []
        self._due = False

    def put(self, message: Message) -> None:
        self._chunks.extend(encode(message))
        self.wake()

    def wake(self) -> None:
        """Write at the end of this turn, whatever is put by then."""
        if not self._due:
            self._due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._due = False
        if self.gather is not None:
            for last in self.gather():
                self._chunks.extend(encode(last))
        chunks, self._chunks = self._chunks, []
        if chunks and not self.transport.is_closing():
            self.transport.writelines(chunks)


class FrameSocket:
    """Messages over a blocking socket, for short exchanges outside an event loop (the
    supervisor's pings, tests and tools)."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self._reader = FrameReader()
        self._bodies: list[bytearray] = []

    def send(self, message: Message) -> None:
        self.socket.sendall(b"".join(bytes(chunk) for chunk in encode(message)))

    def receive(self) -> Message:
        """The next message; ConnectionResetError when the peer closes first."""
        while not self._bodies:
            data = self.socket.recv(1 << 16)
            if not data:
                raise ConnectionResetError("the peer closed the connection")
            self._bodies.extend(self._reader.feed(data))
        return decode(self._bodies.pop(0))


# --- addresses --------------------------------------------------------------------------------


SCHEMES = ("unix", "tcp", "dns+tcp")
ADDRESS_FORMS = "unix:/path, tcp:host:port or dns+tcp:name:port"


@dataclass(frozen=True, slots=True)
class Address:
    """Where a runner listens: `unix:/path/to.sock` or `tcp:host:port`; or, for an API worker
    only, `dns+tcp:name:port`: every address the name resolves to, found again and again
    (`batchserve.api.discovery`), each a `tcp:` address of one runner process."""

    scheme: str
    target: str

    @classmethod
    def parse(cls, text: str) -> Address:
        scheme, sep, target = text.partition(":")
        if not sep or scheme not in SCHEMES or not target:
            raise ValueError(f"address {text!r} must look like {ADDRESS_FORMS}")
        if scheme != "unix":
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"address {text!r} must look like {scheme}:host:port")
        return cls(scheme, target)

    def __str__(self) -> str:
        return f"{self.scheme}:{self.target}"

    def _host_port(self) -> tuple[str, int]:
        host, _, port = self.target.rpartition(":")
        return host, int(port)

    @property
    def host(self) -> str:
        return self._host_port()[0]

    @property
    def port(self) -> int:
        return self._host_port()[1]

    @property
    def tcp(self) -> bool:
        """Whether links to this address go over TCP (and so need a token, and may use TLS)."""
        return self.scheme != "unix"

    @property
    def discovered(self) -> bool:
        """Whether this address names a set of processes to find by DNS, not one process."""
        return self.scheme == "dns+tcp"

    def at(self, ip: str) -> Address:
        """The `tcp:` address of one process this name resolved to."""
        return Address("tcp", f"{ip}:{self.port}")

    async def serve(
        self, factory: Callable[[], asyncio.BaseProtocol], tls: ssl.SSLContext | None = None
    ) -> asyncio.Server:
        loop = asyncio.get_running_loop()
        if self.discovered:
            raise ValueError(f"{self} names processes to find by DNS; listen on tcp:host:port")
        if self.scheme == "unix":
            return await loop.create_unix_server(factory, self.target)
        host, port = self._host_port()
        return await loop.create_server(factory, host, port, ssl=tls)

    async def connect(
        self, factory: Callable[[], Any], tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> tuple[asyncio.Transport, Any]:
        loop = asyncio.get_running_loop()
        if self.discovered:
            raise ValueError(f"{self} names processes to find by DNS, not one to connect to")
        if self.scheme == "unix":
            return await loop.create_unix_connection(factory, self.target)
        host, port = self._host_port()
        return await loop.create_connection(
            factory, host, port, ssl=tls,
            server_hostname=(server_name or host) if tls is not None else None,
        )


def tune(transport: asyncio.BaseTransport, idle_s: float) -> None:
    """TCP_NODELAY (a call is small and must not wait for more), and keepalive probes after
    `idle_s` of silence, so a peer whose host vanished is noticed by the kernel too."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(idle_s))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", idle), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
