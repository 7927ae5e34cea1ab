"""Open Inference Protocol v2 (KServe / Triton REST) codec: request bodies in, response bodies out.

This module owns the request and response documents: their framing, their fields and parameters,
which outputs the runner's signature allows, and the metadata endpoints. Inputs are checked
against the signature by `batchserve.runner.core.signature`, the very check a runner makes of every
call it receives; what one tensor's data holds is read and checked by `batchserve.api.tensors`.
Decoding is strict: every way a request can disagree with the runner's signature is a
`BadRequest` that names the input and what was expected. Outputs are written by orjson or appended
as raw bytes.

The binary tensor data extension (what `tritonclient.http` sends with `binary_data=True`): the
HTTP header `Inference-Header-Content-Length: N` says the first N bytes of the body are the JSON
header; the raw little-endian tensors follow, one for each input that carries
`parameters.binary_data_size`, in the order of the JSON `inputs` list. Responses use the same
layout for the outputs requested with `binary_data`. Tensors travel in the host's byte order,
which is little-endian on every platform batchserve targets (x86-64, arm64). A BYTES tensor's
binary data are its elements in row-major order, each a 4-byte little-endian length and then
its bytes; in JSON its data are strings.

An input declared `batchable: false` has no batch dimension: it does not count a request's rows,
and model metadata marks it with `parameters: {"batchable": false}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Final

import numpy as np
import orjson

from ..runner.core.config import RunnerConfig, TensorSpec
from ..runner.core.signature import Signature, SignatureError
from .errors import BadRequest
from .tensors import (
    HEADER_LENGTH,
    MISSING,
    BinaryData,
    from_binary,
    from_json,
    output_array,
    output_data,
    output_json,
    show,
)

__all__ = [
    "BINARY_TYPE",
    "HEADER_LENGTH",
    "JSON_TYPE",
    "MODEL_VERSION",
    "InferRequest",
    "RequestedOutput",
    "cost",
    "decode_infer",
    "encode_infer",
    "group_of",
    "model_metadata",
    "parse_header_length",
    "server_metadata",
    "signature_of",
    "timeout_of",
]

JSON_TYPE: Final = "application/json"
BINARY_TYPE: Final = "application/octet-stream"
# batchserve serves one version of each model; metadata and responses say so consistently.
MODEL_VERSION: Final = "1"

_EMPTY: Mapping[str, Any] = {}


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    name: str
    binary: bool


# Read-only by convention, not frozen: made once a request, and a frozen dataclass's
# __init__ costs five times a plain one's.
@dataclass(slots=True)
class InferRequest:
    """A decoded, validated inference request; `inputs` follow the signature's order and
    share `rows` along the input batch dimension (1 for ragged or pad inputs: one sequence)."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: tuple[RequestedOutput, ...]
    timeout_s: float | None
    rows: int
    group: tuple[str, ...] = ()
    """The values of the runner's `group_by` parameters, as JSON texts."""


# --- the runner's signature, prepared once per RunnerConfig -----------------------------------


@dataclass(frozen=True, slots=True)
class _Signature:
    inputs: Signature
    outputs: dict[str, TensorSpec]
    requested: dict[tuple[str, bool], RequestedOutput]
    all_outputs: dict[bool, tuple[RequestedOutput, ...]]
    metadata: bytes

    @classmethod
    def of(cls, runner: RunnerConfig) -> _Signature:
        def describe(spec: TensorSpec) -> dict[str, Any]:
            tensor: dict[str, Any] = {
                "name": spec.name, "datatype": spec.datatype, "shape": spec.shape
            }
            if not spec.batchable:
                tensor["parameters"] = {"batchable": False}
            return tensor

        document = {
            "name": runner.name,
            "versions": [MODEL_VERSION],
            "platform": "batchserve",
            "inputs": [describe(spec) for spec in runner.inputs],
            "outputs": [describe(spec) for spec in runner.outputs],
            # v2 leaves model parameters open; a client needs these to split a large batch.
            "parameters": _parameters(runner),
        }
        return cls(
            inputs=Signature(runner),
            outputs={spec.name: spec for spec in runner.outputs},
            requested={
                (spec.name, flag): RequestedOutput(spec.name, flag)
                for spec in runner.outputs
                for flag in (False, True)
            },
            all_outputs={
                flag: tuple(RequestedOutput(spec.name, flag) for spec in runner.outputs)
                for flag in (False, True)
            },
            metadata=orjson.dumps(document),
        )


def _parameters(runner: RunnerConfig) -> dict[str, Any]:
    """The batch limits; for ragged or pad inputs, whose request is one sequence that is
    never split, the cap in elements instead of `max_batch_size`, so a client does not cut.
    A runner that groups by request parameters names them, each with the value it was timed
    with (null when the model's own default was), so a client can make a valid request."""
    limits = _limits(runner)
    if runner.group_by:
        timed = dict(runner.group_timing)
        limits["group_by"] = {name: timed.get(name) for name in runner.group_by}
    return limits


def _limits(runner: RunnerConfig) -> dict[str, Any]:
    if runner.layout == "rows":
        return {
            "max_batch_size": runner.batching.max_batch_size,
            "input_batch_dim": runner.batch_dim[0],
            "output_batch_dim": runner.batch_dim[1],
        }
    return {
        "variable_length": runner.layout,
        "max_batch_elements": runner.max_cost,
        "max_batch_requests": runner.batching.max_batch_size,
        "input_batch_dim": runner.batch_dim[0],
        "output_batch_dim": runner.batch_dim[1],
    }


# Keyed by id() and checked by identity: hashing a RunnerConfig costs more than decoding a row.
_SIGNATURES: dict[int, tuple[RunnerConfig, _Signature]] = {}


def _signature(runner: RunnerConfig) -> _Signature:
    entry = _SIGNATURES.get(id(runner))
    if entry is not None and entry[0] is runner:
        return entry[1]
    signature = _Signature.of(runner)
    _SIGNATURES[id(runner)] = (runner, signature)
    return signature


def signature_of(runner: RunnerConfig) -> _Signature:
    """The runner's inputs' signature, its outputs and requested outputs, prepared once: for
    the gRPC door, which reads the same requests from protocol buffers."""
    return _signature(runner)


# --- small readers of JSON values ---------------------------------------------------------------


# `where` below is a str.format template for the error message, filled in only on failure:
# formatting it for every tensor of every request would cost more than the check itself.


def _object(value: Any, where: str, *args: Any) -> Mapping[str, Any]:
    if value is None:
        return _EMPTY
    if not isinstance(value, dict):
        place = where.format(*args)
        raise BadRequest(f"{place} has value {show(value)}; expected a JSON object")
    return value


def _flag(params: Mapping[str, Any], key: str, default: bool, where: str, *args: Any) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        place = where.format(*args)
        raise BadRequest(f"{place}.{key} has value {show(value)}; expected true or false")
    return value


def _name(item: Any, where: str, *args: Any) -> str:
    if not isinstance(item, dict):
        place = where.format(*args)
        raise BadRequest(f"{place} has value {show(item)}; expected a JSON object with a name")
    name = item.get("name")
    if not isinstance(name, str):
        place = where.format(*args)
        raise BadRequest(f"{place}.name has value {show(name)}; expected a string")
    return name


def _request_id(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"id has value {show(value)}; expected a string")
    return value


def timeout_of(params: Mapping[str, Any]) -> float | None:
    """`parameters.timeout` is in microseconds, and 0 means none (Triton's convention)."""
    value = params.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(
            f"parameters.timeout has value {show(value)}; expected a non-negative integer "
            "number of microseconds"
        )
    return value / 1e6 if value else None


def parse_header_length(value: str | None) -> int | None:
    """Read the `Inference-Header-Content-Length` HTTP header; None when it is absent."""
    if value is None:
        return None
    if not (value.isascii() and value.strip().isdigit()):
        raise BadRequest(f"{HEADER_LENGTH} has value {show(value)}; expected a byte count")
    return int(value)


# --- splitting off binary tensor data -----------------------------------------------------------


def _split(body: bytes, header_length: int | None) -> tuple[Any, BinaryData | None]:
    if header_length is None:
        return body, None
    if header_length < 0 or header_length > len(body):
        raise BadRequest(
            f"{HEADER_LENGTH} is {header_length}; expected at most the body's {len(body)} bytes"
        )
    # A memoryview slice spares copying the header; orjson reads it in place.
    return memoryview(body)[:header_length], BinaryData(body, header_length)


# --- decoding a request -------------------------------------------------------------------------


def _decode_input(
    item: Any, index: int, inputs: Signature, binary: BinaryData | None
) -> tuple[str, np.ndarray]:
    name = _name(item, "inputs[{}]", index)
    spec = inputs.spec(name)
    inputs.check_datatype(spec, item.get("datatype"))
    shape = inputs.check_shape(spec, item.get("shape"))
    params = _object(item.get("parameters"), "input {!r} parameters", name)
    if "shared_memory_region" in params:
        raise BadRequest(f"input {name!r} uses shared memory, which batchserve does not support")
    size = params.get("binary_data_size")
    if size is None:
        array = from_json(spec, shape, item.get("data", MISSING))
    elif "data" in item:
        raise BadRequest(
            f"input {name!r} has both 'data' and parameters.binary_data_size; expected one"
        )
    else:
        array = from_binary(spec, shape, size, binary)
    inputs.check_finite(spec, array)
    return name, array


def _decode_inputs(
    value: Any, inputs: Signature, binary: BinaryData | None
) -> dict[str, np.ndarray]:
    if not isinstance(value, list) or not value:
        raise BadRequest(
            f"inputs has value {show(value)}; expected a non-empty list of tensors "
            "{name, datatype, shape, data}"
        )
    given: dict[str, np.ndarray] = {}
    for index, item in enumerate(value):
        name, array = _decode_input(item, index, inputs, binary)
        if name in given:
            raise BadRequest(f"input {name!r} is given twice; expected it once")
        given[name] = array
    if binary is not None:
        binary.check_used()
    inputs.check_complete(given)
    # The signature's order, so the runner can frame and concatenate without looking names up.
    return {name: given[name] for name in inputs.specs}


def _decode_outputs(
    value: Any, binary_default: bool, signature: _Signature, runner: RunnerConfig
) -> tuple[RequestedOutput, ...]:
    if value is None or value == []:
        return signature.all_outputs[binary_default]
    if not isinstance(value, list):
        raise BadRequest(f"outputs has value {show(value)}; expected a list of {{name}}")
    requested: dict[str, RequestedOutput] = {}
    for index, item in enumerate(value):
        name = _name(item, "outputs[{}]", index)
        if name not in signature.outputs:
            raise BadRequest(
                f"output {name!r} is not an output of model {runner.name!r}; expected one of: "
                + ", ".join(signature.outputs)
            )
        if name in requested:
            raise BadRequest(f"output {name!r} is requested twice; expected it once")
        params = _object(item.get("parameters"), "output {!r} parameters", name)
        if params.get("classification") or "shared_memory_region" in params:
            raise BadRequest(
                f"output {name!r} asks for classification or shared memory, which batchserve "
                "does not support"
            )
        binary = _flag(params, "binary_data", binary_default, "output {!r} parameters", name)
        requested[name] = signature.requested[name, binary]
    return tuple(requested.values())


def _load(header: Any, binary: BinaryData | None) -> Any:
    try:
        return orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        where = "request body" if binary is None else f"JSON header (first {binary.start} bytes)"
        raise BadRequest(f"{where} is not valid JSON: {exc}") from None


def decode_infer(body: bytes, header_length: int | None, runner: RunnerConfig) -> InferRequest:
    """Parse and validate a v2 infer request body against the runner's signature."""
    try:
        return _decode_infer(body, header_length, _signature(runner), runner)
    except SignatureError as exc:
        raise BadRequest(str(exc)) from None


def _decode_infer(
    body: bytes, header_length: int | None, signature: _Signature, runner: RunnerConfig
) -> InferRequest:
    header, binary = _split(body, header_length)
    document = _load(header, binary)
    if not isinstance(document, dict):
        raise BadRequest(
            f"request has value {show(document)}; expected a JSON object "
            "{inputs, outputs?, id?, parameters?}"
        )
    params = _object(document.get("parameters"), "parameters")
    inputs = _decode_inputs(document.get("inputs"), signature.inputs, binary)
    binary_default = _flag(params, "binary_data_output", False, "parameters")
    return InferRequest(
        id=_request_id(document.get("id")),
        inputs=inputs,
        outputs=_decode_outputs(document.get("outputs"), binary_default, signature, runner),
        timeout_s=timeout_of(params),
        rows=signature.inputs.rows(inputs),
        group=group_of(params, runner),
    )


def cost(request: InferRequest, runner: RunnerConfig) -> int:
    """What a decoded request weighs against the runner's cap: rows, or for ragged or pad
    inputs elements (its longest sequence)."""
    return _signature(runner).inputs.cost(request.inputs, request.rows)


def group_of(params: Mapping[str, Any], runner: RunnerConfig) -> tuple[str, ...]:
    """The request's values of the runner's `group_by` parameters: only requests whose values
    are all equal share a batch."""
    values = []
    for name in runner.group_by:
        if name not in params:
            raise BadRequest(
                f"runner {runner.name!r} batches requests by parameters "
                f"{', '.join(runner.group_by)}; the request's parameters lack {name!r}"
            )
        value = params[name]
        if not isinstance(value, str | int | float) or value != value:
            raise BadRequest(f"parameters.{name} has value {show(value)}; expected a string, "
                             "a number or a boolean")
        values.append(orjson.dumps(value).decode())
    return tuple(values)


# --- encoding a response ------------------------------------------------------------------------


def encode_infer(
    model_name: str, request: InferRequest, outputs: dict[str, np.ndarray], runner: RunnerConfig
) -> tuple[bytes, dict[str, str]]:
    """Build the v2 response body and its extra headers (Content-Type, maybe header length)."""
    signature = _signature(runner)
    dim = runner.batch_dim[1]
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview] = []
    for wanted in request.outputs:
        spec = signature.outputs[wanted.name]
        array = output_array(model_name, spec, outputs.get(wanted.name), request.rows, dim)
        tensor: dict[str, Any] = {
            "name": spec.name,
            "datatype": spec.datatype,
            "shape": array.shape,
        }
        if wanted.binary:
            blob = output_data(spec, array)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = output_json(model_name, spec, array)
        tensors.append(tensor)
    response: dict[str, Any] = {"model_name": model_name, "model_version": MODEL_VERSION}
    if request.id is not None:
        response["id"] = request.id
    response["outputs"] = tensors
    header = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, {"Content-Type": JSON_TYPE}
    headers = {"Content-Type": BINARY_TYPE, HEADER_LENGTH: str(len(header))}
    return b"".join([header, *blobs]), headers


# --- metadata -----------------------------------------------------------------------------------


def _version() -> str:
    try:
        return metadata.version("batchserve")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "0+unknown"


_SERVER_METADATA: Final = orjson.dumps(
    {"name": "batchserve", "version": _version(), "extensions": ["binary_tensor_data"]}
)


def server_metadata() -> bytes:
    """`GET /v2`: the server's name, version and protocol extensions."""
    return _SERVER_METADATA


def model_metadata(runner: RunnerConfig, ensemble: bool = False) -> bytes:
    """`GET /v2/models/{name}`: versions, platform, the signature's inputs and outputs, and
    `parameters` with the batch limit and the batch dimensions a client splits along. A
    pipeline's facade (`ensemble`) says `platform: "ensemble"`, as Triton says of its own."""
    metadata = _signature(runner).metadata
    if not ensemble:
        return metadata
    return metadata.replace(b'"platform":"batchserve"', b'"platform":"ensemble"', 1)
