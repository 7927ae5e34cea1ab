"""`ModelInferRequest` in, `ModelInferResponse` out: the v2 tensors over gRPC.

A request's tensors come either all as `raw_input_contents` (little-endian bytes, one entry per
input in the order of `inputs`; BYTES elements each a 4-byte little-endian length and its
bytes, as in HTTP's binary extension) or each in its `contents` field of its datatype. Raw
inputs become `np.frombuffer` views, as HTTP's binary ones do. The checks are HTTP's: the
runner's `Signature`, and `batchserve.api.tensors` for what one tensor holds, so a request
refused over HTTP is refused over gRPC with the same words.

The answer carries `raw_output_contents` when the request sent raw inputs (what
tritonclient.grpc does), else typed `contents`; an output's parameter `binary_data` chooses
for itself. Per-request parameters (`timeout`, a runner's `group_by` values) are HTTP's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
from google.protobuf.message import DecodeError

from ...runner.core.config import RunnerConfig, TensorSpec
from ...runner.core.signature import Signature, SignatureError, shape_text
from ...runner.core.types import BYTES, Tensors
from .. import protocol
from ..errors import BadRequest
from ..tensors import BinaryData, from_binary, from_json, output_array, output_data
from .messages import message

__all__ = ["decode_infer", "encode_infer", "parameters", "read_request"]

_CONTENTS: Final = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
"""The `InferTensorContents` field of each datatype (FP16 has none: it travels raw)."""

InferRequestMessage = message("ModelInferRequest")
InferResponseMessage = message("ModelInferResponse")


def read_request(body: bytes) -> Any:
    """A serialized `ModelInferRequest`, parsed once: its model is read off it, and the request
    admitted or refused by it, before any tensor is decoded (`decode_infer`), as HTTP admits
    on the URL. Parsing leaves the tensors as the bytes they came in."""
    try:
        return InferRequestMessage.FromString(body)
    except DecodeError as exc:
        raise BadRequest(f"the request is not a valid ModelInferRequest: {exc}") from None


def parameters(given: Mapping[str, Any]) -> dict[str, Any]:
    """`map<string, InferParameter>` as the plain values HTTP's parameters hold."""
    found = {}
    for key, value in given.items():
        choice = value.WhichOneof("parameter_choice")
        found[key] = None if choice is None else getattr(value, choice)
    return found


def decode_infer(request: Any, runner: RunnerConfig, deadline_s: float | None
                 ) -> protocol.InferRequest:
    """Check a parsed `ModelInferRequest` (`read_request`) against the runner's signature;
    `deadline_s`, the call's gRPC deadline, shortens the request's own `timeout`."""
    signature = protocol.signature_of(runner)
    try:
        inputs = _inputs(request, signature.inputs)
    except SignatureError as exc:
        raise BadRequest(str(exc)) from None
    params = parameters(request.parameters)
    timeout_s = protocol.timeout_of(params)
    if deadline_s is not None:
        timeout_s = deadline_s if timeout_s is None else min(timeout_s, deadline_s)
    raw = bool(request.raw_input_contents)
    return protocol.InferRequest(
        id=request.id or None,
        inputs=inputs,
        outputs=_outputs(request, raw, signature, runner),
        timeout_s=timeout_s,
        rows=signature.inputs.rows(inputs),
        group=protocol.group_of(params, runner),
    )


def _inputs(request: Any, inputs: Signature) -> dict[str, np.ndarray]:
    if not request.inputs:
        raise BadRequest("the request has no inputs; expected a tensor for each of the "
                         "model's inputs")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"the request has {len(raw)} raw_input_contents for "
                         f"{len(request.inputs)} inputs; expected one for each input, or none")
    given: dict[str, np.ndarray] = {}
    for index, item in enumerate(request.inputs):
        spec = inputs.spec(item.name)
        inputs.check_datatype(spec, item.datatype)
        shape = inputs.check_shape(spec, list(item.shape))
        if "shared_memory_region" in item.parameters:
            raise BadRequest(f"input {spec.name!r} uses shared memory, which batchserve does "
                             "not support")
        if raw:
            if item.HasField("contents"):
                raise BadRequest(f"input {spec.name!r} has both contents and "
                                 "raw_input_contents; expected one")
            array = _from_raw(spec, shape, raw[index], index)
        else:
            array = _from_contents(spec, shape, item.contents)
        inputs.check_finite(spec, array)
        if spec.name in given:
            raise BadRequest(f"input {spec.name!r} is given twice; expected it once")
        given[spec.name] = array
    inputs.check_complete(given)
    return {name: given[name] for name in inputs.specs}


def _from_raw(spec: TensorSpec, shape: tuple[int, ...], data: bytes, index: int
              ) -> np.ndarray:
    if spec.dtype != BYTES:
        expected = math.prod(shape) * spec.dtype.itemsize
        if len(data) != expected:
            raise BadRequest(
                f"input {spec.name!r} has {len(data)} bytes in raw_input_contents[{index}]; "
                f"expected {expected} for shape {shape_text(shape)} of {spec.datatype}")
    return from_binary(spec, shape, len(data), BinaryData(data, 0))


def _from_contents(spec: TensorSpec, shape: tuple[int, ...], contents: Any) -> np.ndarray:
    field = _CONTENTS.get(spec.datatype)
    if field is None:
        raise BadRequest(f"input {spec.name!r} is {spec.datatype}, which has no contents "
                         "field; send it in raw_input_contents")
    data = getattr(contents, field)
    if spec.dtype != BYTES:
        return from_json(spec, shape, list(data))
    count = math.prod(shape)
    if len(data) != count:
        raise BadRequest(f"input {spec.name!r} has {len(data)} elements in {field}; expected "
                         f"{count} for shape {shape_text(shape)}")
    array = np.empty(count, object)
    array[:] = list(data)
    return array.reshape(shape)


def _outputs(request: Any, raw: bool, signature: Any, runner: RunnerConfig
             ) -> tuple[protocol.RequestedOutput, ...]:
    """The outputs asked for, all raw or all in `contents` (raw_output_contents pairs with
    the outputs by position, so it holds every one or none): raw when the inputs came raw, an
    output asks for `binary_data`, or one has no contents field (FP16)."""
    names = [item.name for item in request.outputs] or list(signature.outputs)
    for item in request.outputs:
        name = item.name
        if name not in signature.outputs:
            raise BadRequest(
                f"output {name!r} is not an output of model {runner.name!r}; expected one of: "
                + ", ".join(signature.outputs))
        params = parameters(item.parameters)
        if params.get("classification") or "shared_memory_region" in params:
            raise BadRequest(f"output {name!r} asks for classification or shared memory, "
                             "which batchserve does not support")
        flag = params.get("binary_data", False)
        if not isinstance(flag, bool):
            raise BadRequest(f"output {name!r} parameter binary_data has value {flag!r}; "
                             "expected a bool")
        raw = raw or flag
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise BadRequest(f"output {twice!r} is requested twice; expected it once")
    raw = raw or any(signature.outputs[name].datatype not in _CONTENTS for name in names)
    return tuple(signature.requested[name, raw] for name in names)


def encode_infer(runner: RunnerConfig, request: protocol.InferRequest, outputs: Tensors
                 ) -> bytes:
    """The serialized `ModelInferResponse`: each requested output raw or in `contents`."""
    signature = protocol.signature_of(runner)
    dim = runner.batch_dim[1]
    response = InferResponseMessage(model_name=runner.name,
                                    model_version=protocol.MODEL_VERSION, id=request.id or "")
    raw: list[bytes] = []
    for wanted in request.outputs:
        spec = signature.outputs[wanted.name]
        array = output_array(runner.name, spec, outputs.get(wanted.name), request.rows, dim)
        tensor = response.outputs.add(name=spec.name, datatype=spec.datatype, shape=array.shape)
        if wanted.binary:
            raw.append(bytes(output_data(spec, array)))
        elif spec.dtype == BYTES:
            tensor.contents.bytes_contents.extend(
                item if isinstance(item, bytes) else str(item).encode() for item in array.flat)
        else:
            getattr(tensor.contents, _CONTENTS[spec.datatype]).extend(array.reshape(-1).tolist())
    response.raw_output_contents.extend(raw)
    data: bytes = response.SerializeToString()
    return data
