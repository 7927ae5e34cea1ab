"""What the client sends and reads over gRPC, apart from any channel: the v2 protocol's
messages (`inference.GRPCInferenceService`, from batchserve's own descriptor pool, so a
program may import tritonclient.grpc or KServe's stubs beside it) in and out of the client's
values.

- A request carries its tensors as `raw_input_contents` (the same little-endian bytes as HTTP's
  binary extension), or with `binary=False` in each input's typed `contents` (FP16, which has
  no contents field, stays raw). Its deadline travels as the call's gRPC deadline, not as a
  `timeout` parameter.
- The model's metadata comes from two calls: `ModelMetadata` (names, datatypes, shapes) and
  `ModelConfig`, whose `max_batch_size` and `parameters` (batch dimensions, the inputs that
  are one value per request) say what HTTP's metadata says in its `parameters`.
- An error status is the HTTP status of the same decision (docs/protocol.md's table, read
  backwards), with the reason and `retry-after` from the trailing metadata, so both transports
  raise the same exceptions with the same words.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

import grpc
import numpy as np

from ...runner.core.types import BYTES, DATATYPES, Tensors
from ..grpc.messages import SERVICE, message
from .codec import (
    ModelMetadata,
    Parameters,
    ServerError,
    TensorInfo,
    binary_data,
    bytes_elements,
    check_error,
    retry_after,
)

__all__ = ["METHODS", "check_status", "decode_infer", "encode_infer", "http_status",
           "metadata_of", "metadata_request", "trailers_of"]

METHODS: Final = {name: f"/{SERVICE}/{name}"
                  for name in ("ModelMetadata", "ModelConfig", "ModelInfer")}
"""The full method names of the calls the client makes."""

_CONTENTS: Final = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
"""The `InferTensorContents` field of each datatype (FP16 has none)."""

_STATUS: Final = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.OUT_OF_RANGE: 413, grpc.StatusCode.RESOURCE_EXHAUSTED: 413,
    grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""The HTTP status of the decision each gRPC code stands for; another code is a 500."""


# --- metadata -----------------------------------------------------------------------------------


def metadata_of(described: bytes, config: bytes) -> ModelMetadata:
    """The model's metadata from serialized `ModelMetadataResponse` and `ModelConfigResponse`."""
    try:
        answer = message("ModelMetadataResponse").FromString(described)
        found = message("ModelConfigResponse").FromString(config).config
    except Exception as exc:  # protobuf's DecodeError, or anything it raises on bad bytes
        raise ServerError(200, f"the model metadata is not v2 metadata ({exc!r})") from None
    params = {key: value.string_value for key, value in found.parameters.items()}
    unbatched = set(filter(None, params.get("unbatched_inputs", "").split(",")))
    try:
        return ModelMetadata(
            name=answer.name,
            inputs=tuple(TensorInfo(t.name, t.datatype, tuple(t.shape), t.name not in unbatched)
                         for t in answer.inputs),
            outputs=tuple(TensorInfo(t.name, t.datatype, tuple(t.shape))
                          for t in answer.outputs),
            max_batch_size=found.max_batch_size or None,
            input_batch_dim=int(params.get("input_batch_dim", 0)),
            output_batch_dim=int(params.get("output_batch_dim", 0)),
        )
    except ValueError as exc:
        raise ServerError(200, f"the model configuration is not batchserve's ({exc!r})") from None


def metadata_request(model: str) -> bytes:
    """The serialized request of `ModelMetadata` and of `ModelConfig` (the same fields)."""
    data: bytes = message("ModelMetadataRequest")(name=model).SerializeToString()
    return data


# --- requests and answers -----------------------------------------------------------------------


def encode_infer(model: str, inputs: Mapping[str, np.ndarray], metadata: ModelMetadata,
                 binary: bool, parameters: Parameters | None = None) -> bytes:
    """A serialized `ModelInferRequest` for `inputs` (checked against `metadata` already)."""
    specs = {spec.name: spec for spec in metadata.inputs}
    request = message("ModelInferRequest")(model_name=model)
    raw = binary or any(specs[name].datatype not in _CONTENTS for name in inputs)
    for name, array in inputs.items():
        tensor = request.inputs.add(name=name, datatype=specs[name].datatype, shape=array.shape)
        if raw:
            request.raw_input_contents.append(bytes(binary_data(array)))
        else:
            field = getattr(tensor.contents, _CONTENTS[specs[name].datatype])
            field.extend(array.reshape(-1).tolist())
    for key, value in (parameters or {}).items():
        _set_parameter(request.parameters[key], value)
    data: bytes = request.SerializeToString()
    return data


def _set_parameter(parameter: Any, value: str | int | float | bool) -> None:
    if isinstance(value, bool):  # before int: a bool is an int to Python
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = value


def decode_infer(content: bytes) -> Tensors:
    """The outputs of a serialized `ModelInferResponse`, raw or typed, as writable arrays."""
    try:
        answer = message("ModelInferResponse").FromString(content)
        raw = answer.raw_output_contents
        if raw and len(raw) != len(answer.outputs):
            raise ValueError(f"{len(raw)} raw_output_contents for {len(answer.outputs)} outputs")
        return {tensor.name: _output(tensor, raw[index] if raw else None)
                for index, tensor in enumerate(answer.outputs)}
    except (KeyError, ValueError) as exc:
        raise ServerError(200, f"the answer is not a v2 inference response ({exc!r})") from None
    except Exception as exc:  # protobuf's DecodeError
        raise ServerError(200, f"the answer is not a ModelInferResponse ({exc!r})") from None


def _output(tensor: Any, data: bytes | None) -> np.ndarray:
    dtype = DATATYPES[tensor.datatype]
    shape = tuple(tensor.shape)
    if data is not None and dtype == BYTES:
        return bytes_elements(tensor.name, shape, data, 0, len(data))
    if data is not None:
        if math.prod(shape) * dtype.itemsize != len(data):
            raise ValueError(f"output {tensor.name!r} has {len(data)} bytes that do not fit "
                             f"shape {list(shape)} of {tensor.datatype}")
        return np.frombuffer(data, dtype).reshape(shape).copy()
    values = getattr(tensor.contents, _CONTENTS[tensor.datatype])
    if dtype != BYTES:
        return np.asarray(values, dtype).reshape(shape)
    elements = np.empty(len(values), object)
    elements[:] = list(values)
    return elements.reshape(shape)


# --- error statuses and retries -----------------------------------------------------------------


def check_status(code: grpc.StatusCode, details: str | None,
                 trailers: Iterable[tuple[str, str | bytes]] | None, remaining_s: float
                 ) -> float:
    """A failed call as `codec.check_error` judges an HTTP error answer: the seconds to wait
    before trying again, or raised as the HTTP client raises it. A refusal's reason and delay
    come from the trailing metadata; an expired request (`DEADLINE_EXCEEDED` with a reason)
    is the 503 it is over HTTP, and without one the model's time limit, a 504."""
    found = trailers_of(trailers)
    return check_error(http_status(code, found), details or code.name,
                       found.get("batchserve-reason"), retry_after(found.get("retry-after")),
                       remaining_s)


def trailers_of(trailers: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """Trailing metadata as text by key."""
    return {key: value if isinstance(value, str) else value.decode()
            for key, value in trailers or ()}


def http_status(code: grpc.StatusCode, trailers: Mapping[str, str]) -> int:
    """The HTTP status of the decision a failed call's code and trailers stand for: a 503
    whenever the server names a reason (an expired request is DEADLINE_EXCEEDED over gRPC)."""
    return 503 if "batchserve-reason" in trailers else _STATUS.get(code, 500)
