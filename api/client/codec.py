"""What the Python client sends and reads, apart from any socket: the shared core of
`batchserve.api.client`'s sync, asyncio and futures front ends.

It reads a model's metadata, checks the caller's inputs against it, cuts a batch into chunks
of at most the server's `max_batch_size` and joins the answers in order, encodes a v2 request
(binary tensor data by default, JSON on request), decodes a v2 answer of either kind, and
decides whether an error answer is worth a retry within the caller's deadline.

The inputs it accepts are numpy arrays only (`np.ndarray`): anything else, a list, a torch
tensor or a scalar, is refused with a `ValueError` that says to convert it with `np.asarray`,
so nothing is copied or reinterpreted behind the caller's back. An array whose dtype differs
from the input's datatype is cast when numpy calls that cast `same_kind` (float64 to FP32,
int64 to FP32), and refused otherwise (floats for an integer input).

A BYTES input takes an array of `bytes` or `str` elements (an object array, or numpy's `S` and
`U` kinds); strings go as UTF-8, and BYTES outputs come back as object arrays of `bytes`. An
input the metadata marks `batchable: false` has no batch dimension: it does not count rows,
and every chunk of a split batch carries it whole.
"""

from __future__ import annotations

import email.utils
import math
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any, Final

import numpy as np
import orjson

from ...runner.core.signature import batch_rows
from ...runner.core.types import BYTES, DATATYPES, Tensors

__all__ = [
    "HEADER_LENGTH",
    "ChunkingStrategy",
    "DeadlineExceeded",
    "ModelMetadata",
    "Parameters",
    "ServerError",
    "ServerUnavailable",
    "TensorInfo",
    "batch_rows",
    "binary_data",
    "bytes_elements",
    "check_answer",
    "check_error",
    "check_inputs",
    "decode_response",
    "encode_request",
    "join_chunks",
    "Plan",
    "plan_call",
    "split_along",
    "split_first_dim",
]

HEADER_LENGTH: Final = "Inference-Header-Content-Length"
_LENGTH: Final = struct.Struct("<I")  # a BYTES element's length in binary data

Parameters = Mapping[str, str | int | float | bool]
"""A request's own parameters (a model's `group_by` values, say), sent with every chunk."""

ChunkingStrategy = Callable[[Mapping[str, np.ndarray], int], Iterable[Mapping[str, np.ndarray]]]
"""Takes the named inputs and the server's max batch size; yields chunks of named inputs whose
answers, joined in the order yielded, make the whole batch's answer."""


# --- errors -------------------------------------------------------------------------------------


class ServerError(Exception):
    """The server answered with an error status; `message` is the server's own words."""

    def __init__(self, status: int, message: str, note: str = "") -> None:
        super().__init__(f"the server answered {status}: {message}{note}")
        self.status = status
        self.message = message


class ServerUnavailable(ServerError):
    """A 503 that was not retried: no `Retry-After`, or waiting would pass the deadline.
    `reason` is why the server refused, as its body names it (batchserve's counts its 503s
    under the same reasons), or None when it names none."""

    def __init__(self, message: str, retry_after_s: float | None, note: str,
                 reason: str | None = None) -> None:
        super().__init__(503, message, note)
        self.retry_after_s = retry_after_s
        self.reason = reason


class DeadlineExceeded(TimeoutError):
    """The call's deadline (`timeout_s`) passed before the server answered."""


# --- model metadata -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    datatype: str
    shape: tuple[int, ...]
    batchable: bool = True


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    """What `GET /v2/models/{name}` says; `max_batch_size` is None when the server is silent."""

    name: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    max_batch_size: int | None = None
    input_batch_dim: int = 0
    output_batch_dim: int = 0

    @property
    def unbatched(self) -> frozenset[str]:
        """The inputs without a batch dimension."""
        return frozenset(spec.name for spec in self.inputs if not spec.batchable)

    @classmethod
    def parse(cls, document: Any) -> ModelMetadata:
        try:
            params = document.get("parameters") or {}
            return cls(
                name=str(document["name"]),
                inputs=tuple(_tensor_info(item) for item in document["inputs"]),
                outputs=tuple(_tensor_info(item) for item in document.get("outputs", ())),
                max_batch_size=_optional_int(params.get("max_batch_size")),
                input_batch_dim=int(params.get("input_batch_dim", 0)),
                output_batch_dim=int(params.get("output_batch_dim", 0)),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ServerError(200, f"the model metadata is not v2 metadata ({exc!r})") from None


def _tensor_info(item: Any) -> TensorInfo:
    batchable = (item.get("parameters") or {}).get("batchable", True) is not False
    return TensorInfo(
        str(item["name"]), str(item["datatype"]), tuple(map(int, item["shape"])), batchable
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None or int(value) < 1 else int(value)


# --- checking the caller's inputs ---------------------------------------------------------------


def check_inputs(
    metadata: ModelMetadata, positional: Sequence[Any], named: Mapping[str, Any]
) -> Tensors:
    """Name positional inputs in the model's input order and check every one; see the module
    docstring for what is accepted."""
    order = [spec.name for spec in metadata.inputs]
    if len(positional) > len(order):
        raise ValueError(
            f"{len(positional)} inputs given by position; model {metadata.name!r} has "
            f"{len(order)}: {', '.join(order)}"
        )
    given = dict(zip(order, positional, strict=False))
    for name, value in named.items():
        if name in given:
            raise ValueError(f"input {name!r} is given both by position and by name")
        given[name] = value
    specs = {spec.name: spec for spec in metadata.inputs}
    for name in given:
        if name not in specs:
            raise ValueError(
                f"input {name!r} is not an input of model {metadata.name!r}; expected one of: "
                + ", ".join(order)
            )
    missing = [name for name in order if name not in given]
    if missing:
        raise ValueError(f"input {missing[0]!r} of model {metadata.name!r} is missing")
    return {name: _array(specs[name], given[name]) for name in order}


def _array(spec: TensorInfo, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise ValueError(
            f"input {spec.name!r} is a {type(value).__name__}; expected a numpy array "
            "(np.asarray converts lists and most tensors)"
        )
    dtype = DATATYPES.get(spec.datatype)
    if dtype is None:
        raise ValueError(f"input {spec.name!r} has datatype {spec.datatype}, which this client "
                         "does not send")
    if dtype == BYTES:
        return _bytes_array(spec.name, value)
    if value.dtype == dtype:
        return value
    if not np.can_cast(value.dtype, dtype, "same_kind"):
        raise ValueError(
            f"input {spec.name!r} is an array of {value.dtype}; expected {spec.datatype} "
            f"({dtype}) or a type that casts to it without changing kind"
        )
    return value.astype(dtype)


def _bytes_array(name: str, value: np.ndarray) -> np.ndarray:
    """A BYTES input as an object array of `bytes`: `str` elements become their UTF-8."""
    if value.dtype.kind not in "OSU":
        raise ValueError(f"input {name!r} is an array of {value.dtype}; expected BYTES: "
                         "bytes or str elements")
    elements = np.empty(value.shape, object)
    for index, item in np.ndenumerate(value):
        if isinstance(item, str):
            item = item.encode()
        elif not isinstance(item, bytes):
            raise ValueError(f"input {name!r} holds a {type(item).__name__} at {list(index)}; "
                             "expected BYTES: bytes or str elements")
        elements[index] = item
    return elements


# --- chunking -----------------------------------------------------------------------------------


def split_along(axis: int) -> ChunkingStrategy:
    """A strategy that cuts every input into consecutive slices of at most the max batch size
    along `axis`."""

    def split(inputs: Mapping[str, np.ndarray], max_batch_size: int) -> Iterator[Tensors]:
        rows = batch_rows(inputs, axis)
        lead = (slice(None),) * axis
        for start in range(0, rows, max_batch_size):
            index = (*lead, slice(start, start + max_batch_size))
            yield {name: array[index] for name, array in inputs.items()}

    return split


split_first_dim: Final = split_along(0)
"""The default strategy: slices along the first dimension."""


def join_chunks(answers: Sequence[Tensors], axis: int) -> Tensors:
    """The chunks' outputs joined in order along the output batch dimension."""
    if len(answers) == 1:
        return answers[0]
    return {name: np.concatenate([answer[name] for answer in answers], axis=axis)
            for name in answers[0]}


@dataclass(frozen=True, slots=True)
class Plan:
    """The chunks to send, and how to turn their answers into the caller's answer."""

    chunks: tuple[Tensors, ...]
    finish: Callable[[Sequence[Tensors]], Tensors]
    parameters: Parameters


def plan_call(
    metadata: ModelMetadata, positional: Sequence[Any], named: Mapping[str, Any], *,
    sample: bool, chunking: ChunkingStrategy | None, max_batch_size: int | None,
    parameters: Parameters | None = None,
) -> Plan:
    """Check the inputs and cut them into chunks when they have more rows than the limit
    (`max_batch_size`, else the metadata's); `sample` adds and removes a batch dimension."""
    if sample:  # one row: add the batch dimension here, take it off the answer
        names = [spec.name for spec in metadata.inputs][: len(positional)]
        names += [""] * (len(positional) - len(names))  # extras are refused in check_inputs
        positional = [
            _add_batch_dim(value, metadata, name)
            for value, name in zip(positional, names, strict=True)
        ]
        named = {name: _add_batch_dim(value, metadata, name) for name, value in named.items()}
    inputs = check_inputs(metadata, positional, named)
    unbatched = metadata.unbatched
    rows = batch_rows(inputs, metadata.input_batch_dim, unbatched)
    limit = max_batch_size or metadata.max_batch_size
    chunks: tuple[Tensors, ...] = (inputs,)
    if limit is not None and rows > limit:
        strategy = chunking or split_along(metadata.input_batch_dim)
        batched = {name: array for name, array in inputs.items() if name not in unbatched}
        whole = {name: array for name, array in inputs.items() if name in unbatched}
        chunks = tuple({**chunk, **whole} for chunk in strategy(batched, limit))
        if not chunks:
            raise ValueError("the chunking strategy returned no chunks")
    axis = metadata.output_batch_dim

    def finish(answers: Sequence[Tensors]) -> Tensors:
        joined = join_chunks(answers, axis)
        if not sample:
            return joined
        index = (slice(None),) * axis + (0,)
        return {name: array[index] for name, array in joined.items()}

    return Plan(chunks, finish, _parameters(parameters))


def _parameters(parameters: Parameters | None) -> Parameters:
    given = dict(parameters or {})
    for name, value in given.items():
        if not isinstance(value, str | int | float):
            raise ValueError(f"parameter {name!r} is a {type(value).__name__}; expected a "
                             "string, a number or a boolean")
    if "timeout" in given:
        raise ValueError("parameter 'timeout' is the client's own: give timeout_s instead")
    return given


def _add_batch_dim(value: Any, metadata: ModelMetadata, name: str) -> Any:
    # Anything but an array goes through as it is, to be refused by name in check_inputs.
    if isinstance(value, np.ndarray) and name not in metadata.unbatched:
        return np.expand_dims(value, metadata.input_batch_dim)
    return value


# --- requests and answers -----------------------------------------------------------------------


def encode_request(
    inputs: Mapping[str, np.ndarray], metadata: ModelMetadata, binary: bool, timeout_s: float,
    parameters: Parameters | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A v2 infer body and its headers; the deadline left travels as `parameters.timeout`."""
    specs = {spec.name: spec for spec in metadata.inputs}
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview] = []
    for name, array in inputs.items():
        tensor: dict[str, Any] = {
            "name": name, "datatype": specs[name].datatype, "shape": list(array.shape),
        }
        if binary:
            blob = binary_data(array)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = _json_data(name, array)
        tensors.append(tensor)
    document = {
        "inputs": tensors,
        "outputs": [{"name": spec.name, "parameters": {"binary_data": binary}}
                    for spec in metadata.outputs],
        # microseconds, at least one: 0 would mean no deadline at all
        "parameters": {**(parameters or {}), "timeout": max(1, int(timeout_s * 1e6))},
    }
    header = orjson.dumps(document)
    if not binary:
        return header, {"Content-Type": "application/json"}
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return b"".join([header, *blobs]), headers


def binary_data(array: np.ndarray) -> bytes | memoryview:
    """Raw little-endian elements; a BYTES tensor's elements each behind a 4-byte length."""
    if array.dtype == BYTES:
        return b"".join(
            part for item in array.flat for part in (_LENGTH.pack(len(item)), item)
        )
    data = np.ascontiguousarray(array)
    return data.data.cast("B") if data.nbytes else b""


def _json_data(name: str, array: np.ndarray) -> list[Any]:
    """The flat JSON data: BYTES as strings, which JSON can carry only for UTF-8 text."""
    if array.dtype != BYTES:
        data: list[Any] = array.reshape(-1).tolist()
        return data
    try:
        return [item.decode() for item in array.flat]
    except UnicodeDecodeError:
        raise ValueError(f"input {name!r} holds bytes that are not UTF-8, which JSON cannot "
                         "carry; send it with binary=True") from None


def decode_response(headers: Mapping[str, str], content: bytes) -> Tensors:
    """The outputs of a 200 answer, JSON or with binary tensor data, as writable arrays."""
    try:
        length = headers.get(HEADER_LENGTH)
        start = len(content) if length is None else int(length)
        document = orjson.loads(memoryview(content)[:start])
        outputs: Tensors = {}
        for item in document["outputs"]:
            array, start = _output(item, content, start)
            outputs[item["name"]] = array
        return outputs
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
        raise ServerError(200, f"the answer is not a v2 inference response ({exc!r})") from None


def _output(item: Mapping[str, Any], content: bytes, offset: int) -> tuple[np.ndarray, int]:
    dtype = DATATYPES[item["datatype"]]
    shape = tuple(item["shape"])
    size = (item.get("parameters") or {}).get("binary_data_size")
    if dtype == BYTES:
        return _bytes_output(item, shape, size, content, offset)
    if size is None:
        return np.asarray(item["data"], dtype).reshape(shape), offset
    count = math.prod(shape)
    if count * dtype.itemsize != size or offset + size > len(content):
        raise ValueError(f"output {item['name']!r} has {size} bytes of binary data that do "
                         f"not fit shape {list(shape)} of {item['datatype']}")
    array = np.frombuffer(content, dtype, count, offset).reshape(shape).copy()
    return array, offset + size


def _bytes_output(
    item: Mapping[str, Any], shape: tuple[int, ...], size: int | None, content: bytes, offset: int
) -> tuple[np.ndarray, int]:
    """A BYTES output as an object array of `bytes`, from JSON strings or length-prefixed
    binary data."""
    if size is None:
        elements = np.empty(math.prod(shape), object)
        elements[:] = [text.encode() for text in item["data"]]
        return elements.reshape(shape), offset
    end = offset + size
    return bytes_elements(item["name"], shape, content, offset, end), end


def bytes_elements(name: str, shape: tuple[int, ...], content: bytes | memoryview, start: int,
                   end: int) -> np.ndarray:
    """The BYTES elements of `content[start:end]`, each a 4-byte little-endian length and
    its bytes, as an object array of `shape`."""
    elements = np.empty(math.prod(shape), object)
    at = start
    for index in range(elements.size):
        if at + _LENGTH.size > end:
            raise ValueError(f"output {name!r} has BYTES data that end at element {index}")
        (length,) = _LENGTH.unpack_from(content, at)
        at += _LENGTH.size
        if at + length > end:
            raise ValueError(f"output {name!r} has BYTES element {index} past its data")
        elements[index] = bytes(content[at : at + length])
        at += length
    if at != end:
        raise ValueError(f"output {name!r} has {end - at} bytes past its elements")
    return elements.reshape(shape)


# --- error answers and retries ------------------------------------------------------------------


def check_answer(
    status: int, headers: Mapping[str, str], content: bytes, remaining_s: float
) -> float | None:
    """None for a success; for a 503 whose `Retry-After` fits in the `remaining_s` of the
    deadline, the seconds to wait before trying again; any other error is raised."""
    if 200 <= status < 300:
        return None
    message, reason = _error_body(content)
    return check_error(status, message, reason, retry_after(headers.get("Retry-After")),
                       remaining_s)


def check_error(status: int, message: str, reason: str | None, delay: float | None,
                remaining_s: float) -> float:
    """An error answer of either transport, as its HTTP status, the server's words, the
    reason it names and its retry delay: the seconds to wait before trying again when it is
    a 503 whose delay fits in the `remaining_s` of the deadline; else raised."""
    if status != 503:
        raise ServerError(status, message)
    if delay is None:
        raise ServerUnavailable(message, None, " (no Retry-After: not retried)", reason)
    if delay >= remaining_s:
        raise ServerUnavailable(
            message, delay,
            f" (retrying after {delay:g} s would pass the deadline, {remaining_s:.3g} s away)",
            reason,
        )
    return delay


def retry_after(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """`Retry-After` in seconds: a number of seconds, or an HTTP date; None when unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    # An HTTP date is wall-clock time by definition, so this one reading of it is too.
    return max(0.0, when.timestamp() - now())


def _error_body(content: bytes) -> tuple[str, str | None]:
    """The server's `{"error": "...", "reason": "..."}` text and reason, or the body itself
    (and no reason) when it is something else."""
    try:
        document = orjson.loads(content)
    except orjson.JSONDecodeError:
        document = None
    if not isinstance(document, dict):
        document = {}
    error, reason = document.get("error"), document.get("reason")
    reason = reason if isinstance(reason, str) else None
    if isinstance(error, str):
        return error, reason
    text = content[:300].decode("utf-8", "replace")
    return text or "(empty body)", reason
