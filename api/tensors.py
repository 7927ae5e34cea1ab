"""One v2 tensor's data against its `TensorSpec`: data in, output out.

Why a module of its own: `batchserve.api.protocol` reads the request document (its fields,
parameters and framing) and checks each input's declared name, datatype and shape with the
runner's `batchserve.runner.core.signature.Signature`; this reads what a single tensor holds, which
is where the cost and the subtle checks are. Tensor data never passes through a per-element
Python loop: JSON lists go through `np.asarray`, binary tensors become `np.frombuffer` views into
the request body (zero copy, read-only), and every value must fit the input's datatype in kind
and range; a disagreement is a `BadRequest` that names the input and what was expected. A model
output that disagrees with its signature is the server's bug, a `BatchserveError`.

BYTES tensors are the exception to the no-loop rule, since each element is a string of its own
length: in JSON their data are strings (sent as UTF-8), in binary each element is a 4-byte
little-endian length followed by that many bytes, the layout of the v2 binary tensor extension.
They become numpy object arrays of `bytes`.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Final

import numpy as np

from ..runner.core.config import TensorSpec
from ..runner.core.signature import fits, shape_text, show
from ..runner.core.types import BYTES, DATATYPES
from .errors import BadRequest, BatchserveError

__all__ = [
    "HEADER_LENGTH",
    "MISSING",
    "BinaryData",
    "from_binary",
    "from_json",
    "output_array",
    "output_data",
    "output_json",
    "shape_text",
    "show",
]

# The binary tensor data extension's HTTP header. It is defined here, below
# `batchserve.api.protocol`, because a binary input that arrives without it is refused with its
# name.
HEADER_LENGTH: Final = "Inference-Header-Content-Length"
# What `from_json` is given for an input without a "data" member.
MISSING: Final = object()
# numpy kinds that `np.asarray` may infer from JSON data, accepted for each kind of datatype.
_ACCEPTED_KINDS = {"f": "fiu", "i": "iu", "u": "iu", "b": "b"}
_KIND_WORDS = {"f": "numbers", "i": "integers", "u": "integers", "b": "booleans (true/false)"}
# A BYTES element's length prefix in binary data.
_LENGTH: Final = struct.Struct("<I")


# --- binary tensor data -------------------------------------------------------------------------


class BinaryData:
    """The body after the JSON header, handed out to binary inputs in order."""

    __slots__ = ("body", "start", "cursor")

    def __init__(self, body: bytes, start: int) -> None:
        self.body = body
        self.start = start
        self.cursor = start

    def take(self, name: str, size: int) -> int:
        offset = self.cursor
        if offset + size > len(self.body):
            raise BadRequest(
                f"input {name!r} needs {size} bytes of binary data at offset "
                f"{offset - self.start}, but only {len(self.body) - offset} remain"
            )
        self.cursor = offset + size
        return offset

    def check_used(self) -> None:
        unused = len(self.body) - self.cursor
        if unused:
            raise BadRequest(
                f"the request has {len(self.body) - self.start} bytes of binary data after its "
                f"JSON header; its inputs use {self.cursor - self.start}"
            )


def from_binary(
    spec: TensorSpec, shape: tuple[int, ...], size: Any, binary: BinaryData | None
) -> np.ndarray:
    name = spec.name
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise BadRequest(f"input {name!r} has binary_data_size {show(size)}; expected a byte count")
    if spec.dtype == BYTES:
        return _bytes_from_binary(spec, shape, size, binary)
    count = math.prod(shape)
    expected = count * spec.dtype.itemsize
    if size != expected:
        raise BadRequest(
            f"input {name!r} has binary_data_size {size}; expected {expected} bytes "
            f"for shape {shape_text(shape)} of {spec.datatype}"
        )
    data = _no_header(name, binary)
    offset = data.take(name, size)
    if count == 0:
        return np.zeros(shape, spec.dtype)
    array = np.frombuffer(data.body, spec.dtype, count, offset).reshape(shape)
    if spec.datatype == "BOOL" and array.view(np.uint8).max() > 1:
        raise BadRequest(f"input {name!r} has BOOL bytes other than 0 and 1")
    return array


def _no_header(name: str, binary: BinaryData | None) -> BinaryData:
    if binary is None:
        raise BadRequest(
            f"input {name!r} has parameters.binary_data_size, but the request has no "
            f"{HEADER_LENGTH} header to delimit its binary data"
        )
    return binary


def _bytes_from_binary(
    spec: TensorSpec, shape: tuple[int, ...], size: int, binary: BinaryData | None
) -> np.ndarray:
    """Read `count` elements of a 4-byte little-endian length and that many bytes."""
    name, data = spec.name, _no_header(spec.name, binary)
    body, start = data.body, data.take(spec.name, size)
    end, offset = start + size, start
    array = np.empty(math.prod(shape), object)
    for i in range(array.size):
        if offset + _LENGTH.size > end:
            raise BadRequest(
                f"input {name!r} has BYTES binary data that end inside the length of element "
                f"{i}; its binary_data_size {size} holds {i} of the {array.size} elements"
            )
        (length,) = _LENGTH.unpack_from(body, offset)
        offset += _LENGTH.size
        if offset + length > end:
            raise BadRequest(
                f"input {name!r} has BYTES element {i} of {length} bytes, past the end of its "
                f"binary data ({end - offset} bytes remain of binary_data_size {size})"
            )
        array[i] = body[offset : offset + length]
        offset += length
    if offset != end:
        raise BadRequest(
            f"input {name!r} has binary_data_size {size}; its {array.size} BYTES elements "
            f"for shape {shape_text(shape)} use {offset - start}"
        )
    return array.reshape(shape)


# --- JSON tensor data ---------------------------------------------------------------------------


def _limits(dtype: np.dtype[Any]) -> tuple[float, float] | None:
    if dtype.kind == "f":
        info = np.finfo(dtype)
        return float(info.min), float(info.max)
    if dtype.kind in "iu":
        bounds = np.iinfo(dtype)
        return bounds.min, bounds.max
    return None


_LIMITS = {name: _limits(dtype) for name, dtype in DATATYPES.items()}


def from_json(spec: TensorSpec, shape: tuple[int, ...], data: Any) -> np.ndarray:
    name = spec.name
    if data is MISSING:
        raise BadRequest(
            f"input {name!r} has neither 'data' nor parameters.binary_data_size; expected one"
        )
    if not isinstance(data, list):
        raise BadRequest(f"input {name!r} has data {show(data)}; expected a list")
    if spec.dtype == BYTES:
        return _bytes_from_json(spec, shape, data)
    try:
        raw = np.asarray(data)
    except ValueError:
        raise BadRequest(
            f"input {name!r} has nested data of uneven lengths; expected a flat list or "
            f"lists nested as its shape {shape_text(shape)}"
        ) from None
    _check_layout(spec, shape, raw)
    # An empty list parses as float64: nothing to check, `_convert` casts it.
    if raw.size and (raw.dtype.kind == "O" or (raw.dtype.kind == "f" and spec.dtype.kind in "iu")):
        raw = _big_integers(spec, data)
    return _convert(spec, raw).reshape(shape)


def _check_layout(spec: TensorSpec, shape: tuple[int, ...], raw: np.ndarray) -> None:
    """The data hold as many elements as the shape, flat or nested as the shape."""
    name, count = spec.name, math.prod(shape)
    if raw.size != count:
        raise BadRequest(
            f"input {name!r} has {raw.size} data elements; its shape {shape_text(shape)} "
            f"needs {count}"
        )
    if raw.ndim != 1 and raw.shape != shape:
        raise BadRequest(
            f"input {name!r} has data nested as {shape_text(raw.shape)}; expected a flat list "
            f"or lists nested as its shape {shape_text(shape)}"
        )


def _bytes_from_json(spec: TensorSpec, shape: tuple[int, ...], data: list[Any]) -> np.ndarray:
    """BYTES data are JSON strings, each sent to the model as its UTF-8 bytes."""
    try:
        raw = np.array(data, dtype=object)  # lists nested unevenly stay lists, refused below
    except ValueError:
        raise BadRequest(
            f"input {spec.name!r} has nested data of uneven lengths; expected a flat list or "
            f"lists nested as its shape {shape_text(shape)}"
        ) from None
    encoded = np.empty(raw.shape, object)
    for index, item in np.ndenumerate(raw):
        if type(item) is not str:
            raise BadRequest(
                f"input {spec.name!r} has data that are not all strings; expected BYTES "
                "values as JSON strings"
            )
        encoded[index] = item.encode()
    _check_layout(spec, shape, encoded)
    return encoded.reshape(shape)


def _big_integers(spec: TensorSpec, data: list[Any]) -> np.ndarray:
    """Read integers numpy cannot type: beyond 64 bits (object) or either side of 2**63 (float).

    A rare path, or an error path (floats for an integer input, null, mixed types), so a
    per-element check is affordable here.
    """
    items = np.asarray(data, dtype=object)
    if spec.dtype.kind == "b" or not all(type(item) is int for item in items.flat):
        raise _wrong_kind(spec)
    target = {"f": np.float64, "u": np.uint64}.get(spec.dtype.kind)
    if target is None:  # signed: these values lie beyond INT64, so beyond every signed type
        raise _out_of_range(spec)
    try:
        return items.astype(target)  # _convert then checks the range of the input's dtype
    except OverflowError:
        raise _out_of_range(spec) from None


def _wrong_kind(spec: TensorSpec) -> BadRequest:
    return BadRequest(
        f"input {spec.name!r} has data that are not all {_KIND_WORDS[spec.dtype.kind]}; "
        f"expected {spec.datatype} values"
    )


def _out_of_range(spec: TensorSpec) -> BadRequest:
    low, high = _LIMITS[spec.datatype] or (0, 0)
    return BadRequest(
        f"input {spec.name!r} has values outside the range of {spec.datatype} [{low:g}, {high:g}]"
    )


def _convert(spec: TensorSpec, raw: np.ndarray) -> np.ndarray:
    """Cast parsed JSON data to the input's dtype, refusing other kinds and lossy ranges."""
    dtype = spec.dtype
    if raw.dtype == dtype or raw.size == 0:
        return raw.astype(dtype, copy=False)
    if raw.dtype.kind not in _ACCEPTED_KINDS[dtype.kind]:
        raise _wrong_kind(spec)
    limits = _LIMITS[spec.datatype]
    # JSON integers (int64/uint64) always fit FP32 and FP64; everything else may not.
    exact = raw.dtype.kind in "iu" and dtype.kind == "f" and dtype.itemsize >= 4
    if limits is not None and not exact and not _within(raw, limits):
        raise _out_of_range(spec)
    return raw.astype(dtype)


def _within(raw: np.ndarray, limits: tuple[float, float]) -> bool:
    """Whether every element lies within `limits`. JSON floats bound to a narrower float are
    judged by their sum of squares first, one BLAS call where `min` and `max` take two
    reductions at four times the cost; the exact check runs only when that sum says an
    element may lie outside (JSON has no NaN or infinity, so the sum is a bound)."""
    low, high = limits
    if raw.dtype.kind == "f" and low == -high and np.vdot(raw, raw) <= high * high:
        return True
    return bool(raw.min() >= low and raw.max() <= high)


# --- model outputs ------------------------------------------------------------------------------


def output_array(
    model: str, spec: TensorSpec, value: np.ndarray | None, rows: int, dim: int
) -> np.ndarray:
    """The model's output as the signature says, or a 500: a mismatch is the server's bug."""
    if value is None:
        raise BatchserveError(f"model {model!r} returned no output {spec.name!r}")
    array = np.asarray(value)
    if array.dtype != spec.dtype:
        if spec.dtype == BYTES or not np.can_cast(array.dtype, spec.dtype, "same_kind"):
            raise BatchserveError(
                f"model {model!r} returned output {spec.name!r} as {array.dtype}; its "
                f"signature says {spec.datatype}"
            )
        array = array.astype(spec.dtype)
    shape = array.shape
    # A ragged output is one flat sequence a request, of any length: no rows to count.
    if not fits(shape, spec.shape) or (shape[dim] != rows and spec.layout != "ragged"):
        raise BatchserveError(
            f"model {model!r} returned output {spec.name!r} with shape {shape_text(shape)}; "
            f"expected {shape_text(spec.shape)} with {rows} rows in dimension {dim}"
        )
    return np.ascontiguousarray(array)


def output_data(spec: TensorSpec, array: np.ndarray) -> bytes | memoryview:
    """An output's binary data: raw elements, or length-prefixed elements for BYTES."""
    if spec.dtype != BYTES:
        return array.data.cast("B")
    return b"".join([part for item in array.flat for part in (_LENGTH.pack(len(item)), item)])


def output_json(model: str, spec: TensorSpec, array: np.ndarray) -> Any:
    """An output's JSON data, flat and row-major as the v2 protocol writes it; BYTES as
    strings, which JSON can only carry for UTF-8 text."""
    if spec.dtype != BYTES:
        return array.reshape(-1)
    try:
        return [item.decode() for item in array.flat]
    except UnicodeDecodeError:
        raise BadRequest(
            f"output {spec.name!r} of model {model!r} holds bytes that are not UTF-8, which "
            "JSON cannot carry; ask for it with parameters.binary_data: true"
        ) from None
