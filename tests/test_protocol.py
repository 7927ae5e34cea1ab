"""The v2 codec: interop with tritonclient's own request/response code, and every refusal.

tritonclient builds the request bodies and parses the response bodies, so these tests prove the
wire format without a server.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from batchserve.api.errors import BadRequest, BatchserveError
from batchserve.api.protocol import (
    HEADER_LENGTH,
    InferRequest,
    RequestedOutput,
    decode_infer,
    encode_infer,
    model_metadata,
    parse_header_length,
    server_metadata,
)
from batchserve.runner.core.config import Batching, RunnerConfig, TensorSpec
from batchserve.runner.core.types import DATATYPES

MLP = RunnerConfig(
    name="mlp",
    model="models:mlp",
    inputs=(TensorSpec("x", "FP32", (-1, 256)),),
    outputs=(TensorSpec("y", "FP32", (-1, 16)),),
)
MULTI = RunnerConfig(
    name="multi",
    model="models:multi",
    inputs=(
        TensorSpec("a", "FP32", (-1, 4)),
        TensorSpec("b", "INT32", (-1,)),
        TensorSpec("c", "BOOL", (-1, 2)),
    ),
    outputs=(TensorSpec("y", "FP32", (-1, 3)), TensorSpec("z", "INT64", (-1,))),
)


def one(datatype: str, batch_dim: int = 0) -> RunnerConfig:
    """A runner with one input and one output of `datatype`, batched along `batch_dim`."""
    shape = (-1, 3) if batch_dim == 0 else (3, -1)
    return RunnerConfig(
        name="one",
        model="models:one",
        inputs=(TensorSpec("x", datatype, shape),),
        outputs=(TensorSpec("y", datatype, shape),),
        batch_dim=(batch_dim, batch_dim),
    )


def sample(datatype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = DATATYPES[datatype]
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * 100).astype(dtype)
    if datatype == "BYTES":  # UTF-8 text of varied lengths, empty strings and NUL included
        words = ["", "a", "\0nul", "naïve café ☕", "x" * int(rng.integers(1, 300))]
        picks = rng.integers(0, len(words), shape)
        return np.vectorize(lambda i: words[i].encode(), otypes=[object])(picks)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def triton_body(
    arrays: dict[str, np.ndarray],
    binary: bool,
    outputs: dict[str, bool] | None = None,
    **kwargs: Any,
) -> tuple[bytes, int | None]:
    inputs = []
    for name, array in arrays.items():
        datatype = next(k for k, v in DATATYPES.items() if v == array.dtype)
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    requested = None
    if outputs is not None:
        requested = [triton.InferRequestedOutput(n, binary_data=b) for n, b in outputs.items()]
    body, json_size = triton.InferenceServerClient.generate_request_body(
        inputs, outputs=requested, **kwargs
    )
    return body, json_size


def triton_result(body: bytes, headers: dict[str, str]) -> Any:
    length = headers.get(HEADER_LENGTH)
    return triton.InferenceServerClient.parse_response_body(
        body, header_length=None if length is None else int(length)
    )


def json_body(inputs: list[Any], **extra: Any) -> bytes:
    # The standard library, because orjson refuses to write integers beyond 64 bits.
    return json.dumps({"inputs": inputs, **extra}).encode()


def x_input(**overrides: Any) -> dict[str, Any]:
    return {"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256, **overrides}


def binary_body(header: dict[str, Any], *blobs: bytes) -> tuple[bytes, int]:
    head = orjson.dumps(header)
    return head + b"".join(blobs), len(head)


def refused(message: str) -> Any:
    """Expect a BadRequest with exactly this message."""
    return pytest.raises(BadRequest, match="^" + re.escape(message) + "$")


# --- interop with tritonclient ------------------------------------------------------------------


@pytest.mark.parametrize("binary_in", [True, False], ids=["binary-in", "json-in"])
@pytest.mark.parametrize("binary_out", [True, False], ids=["binary-out", "json-out"])
def test_tritonclient_round_trip(binary_in: bool, binary_out: bool) -> None:
    x = sample("FP32", (3, 256))
    body, json_size = triton_body({"x": x}, binary_in, {"y": binary_out}, request_id="r-1")
    request = decode_infer(body, json_size, MLP)
    assert request.id == "r-1"
    assert request.rows == 3
    assert request.outputs == (RequestedOutput("y", binary_out),)
    np.testing.assert_array_equal(request.inputs["x"], x)
    y = sample("FP32", (3, 16), seed=1)
    content, headers = encode_infer("mlp", request, {"y": y}, MLP)
    assert (HEADER_LENGTH in headers) is binary_out
    expected_type = "application/octet-stream" if binary_out else "application/json"
    assert headers["Content-Type"] == expected_type
    result = triton_result(content, headers)
    np.testing.assert_array_equal(result.as_numpy("y"), y)
    assert result.get_response()["id"] == "r-1"
    assert result.get_response()["model_name"] == "mlp"


@pytest.mark.parametrize("datatype", list(DATATYPES))
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_every_datatype_round_trips(datatype: str, binary: bool) -> None:
    runner = one(datatype)
    x = sample(datatype, (2, 3))
    body, json_size = triton_body({"x": x}, binary, {"y": binary})
    request = decode_infer(body, json_size, runner)
    assert request.inputs["x"].dtype == DATATYPES[datatype]
    np.testing.assert_array_equal(request.inputs["x"], x)
    content, headers = encode_infer("one", request, {"y": x}, runner)
    result = triton_result(content, headers)
    assert result.as_numpy("y").dtype == DATATYPES[datatype]
    if datatype == "BYTES" and not binary:  # tritonclient reads JSON strings as str
        x = np.vectorize(bytes.decode, otypes=[object])(x)
    np.testing.assert_array_equal(result.as_numpy("y"), x)


def test_tritonclient_without_outputs_gets_all_outputs_in_binary() -> None:
    arrays = {"a": sample("FP32", (2, 4)), "b": sample("INT32", (2,)), "c": sample("BOOL", (2, 2))}
    body, json_size = triton_body(arrays, True)
    request = decode_infer(body, json_size, MULTI)
    assert request.outputs == (RequestedOutput("y", True), RequestedOutput("z", True))
    y, z = sample("FP32", (2, 3)), np.array([7, -7], np.int64)
    content, headers = encode_infer("multi", request, {"y": y, "z": z}, MULTI)
    result = triton_result(content, headers)
    np.testing.assert_array_equal(result.as_numpy("y"), y)
    np.testing.assert_array_equal(result.as_numpy("z"), z)


def test_mixed_binary_and_json_inputs_and_outputs() -> None:
    arrays = {"a": sample("FP32", (2, 4)), "b": sample("INT32", (2,)), "c": sample("BOOL", (2, 2))}
    inputs = []
    for name, array in arrays.items():
        datatype = {"a": "FP32", "b": "INT32", "c": "BOOL"}[name]
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=name != "b")
        inputs.append(tensor)
    outputs = [
        triton.InferRequestedOutput("z", binary_data=False),
        triton.InferRequestedOutput("y", binary_data=True),
    ]
    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    request = decode_infer(body, json_size, MULTI)
    for name, array in arrays.items():
        np.testing.assert_array_equal(request.inputs[name], array)
    assert list(request.inputs) == ["a", "b", "c"]
    assert request.outputs == (RequestedOutput("z", False), RequestedOutput("y", True))
    y, z = sample("FP32", (2, 3)), np.array([1, 2], np.int64)
    content, headers = encode_infer("multi", request, {"y": y, "z": z}, MULTI)
    result = triton_result(content, headers)
    np.testing.assert_array_equal(result.as_numpy("y"), y)
    np.testing.assert_array_equal(result.as_numpy("z"), z)
    assert result.get_output("z")["data"] == [1, 2]


def test_timeout_is_read_in_microseconds() -> None:
    body, json_size = triton_body({"x": sample("FP32", (1, 256))}, True, timeout=250_000)
    assert decode_infer(body, json_size, MLP).timeout_s == pytest.approx(0.25)


def test_binary_inputs_are_views_into_the_body() -> None:
    x = sample("FP32", (2, 256))
    body, json_size = triton_body({"x": x}, True)
    array = decode_infer(body, json_size, MLP).inputs["x"]
    assert np.shares_memory(array, np.frombuffer(body, np.uint8))
    assert not array.flags.writeable


def test_batch_dimension_other_than_zero() -> None:
    runner = one("INT64", batch_dim=1)
    x = np.arange(15, dtype=np.int64).reshape(3, 5)
    body, json_size = triton_body({"x": x}, True)
    request = decode_infer(body, json_size, runner)
    assert request.rows == 5
    content, headers = encode_infer("one", request, {"y": x}, runner)
    np.testing.assert_array_equal(triton_result(content, headers).as_numpy("y"), x)


# --- the JSON flavor ----------------------------------------------------------------------------


def test_json_request_with_flat_data() -> None:
    # Two rows sent flat, each value distinct (and exact in FP32): the decoder must lay them
    # out row by row, in order, as float32.
    flat = [(i - 256) / 8 for i in range(512)]
    request = decode_infer(json_body([x_input(shape=[2, 256], data=flat)]), None, MLP)
    assert dataclasses.replace(request, inputs={}) == InferRequest(
        id=None,
        inputs={},
        outputs=(RequestedOutput("y", False),),
        timeout_s=None,
        rows=2,
    )
    assert list(request.inputs) == ["x"]
    x = request.inputs["x"]
    assert x.dtype == np.float32
    assert x.shape == (2, 256)
    assert x[0, 0] == -32.0 and x[0, 1] == -31.875 and x[0, 255] == -0.125
    assert x[1, 0] == 0.0 and x[1, 1] == 0.125 and x[1, 255] == 31.875
    expected = np.array([[-32 + c / 8 for c in range(256)], [c / 8 for c in range(256)]],
                        dtype=np.float32)
    np.testing.assert_array_equal(x, expected, strict=True)


def test_json_request_with_nested_data_and_integers_for_floats() -> None:
    data = [list(range(256)), [1.5] * 256]
    request = decode_infer(json_body([x_input(shape=[2, 256], data=data)]), None, MLP)
    np.testing.assert_array_equal(request.inputs["x"], np.array(data, np.float32))


def test_json_response_is_exact() -> None:
    request = decode_infer(json_body([x_input()], id="42"), None, MLP)
    y = np.arange(16, dtype=np.float32).reshape(1, 16) / 4
    content, headers = encode_infer("mlp", request, {"y": y}, MLP)
    assert headers == {"Content-Type": "application/json"}
    assert orjson.loads(content) == {
        "model_name": "mlp",
        "model_version": "1",
        "id": "42",
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [1, 16], "data": y.ravel().tolist()}
        ],
    }


def test_binary_data_output_sets_the_default_and_outputs_override_it() -> None:
    params = {"binary_data_output": True}
    request = decode_infer(json_body([x_input()], parameters=params), None, MLP)
    assert request.outputs == (RequestedOutput("y", True),)
    outputs = [{"name": "y", "parameters": {"binary_data": False}}]
    request = decode_infer(json_body([x_input()], parameters=params, outputs=outputs), None, MLP)
    assert request.outputs == (RequestedOutput("y", False),)


def test_zero_timeout_means_none() -> None:
    body = json_body([x_input()], parameters={"timeout": 0})
    assert decode_infer(body, None, MLP).timeout_s is None


def test_encode_casts_same_kind_outputs() -> None:
    request = decode_infer(json_body([x_input()]), None, MLP)
    content, _ = encode_infer("mlp", request, {"y": np.ones((1, 16), np.float64)}, MLP)
    assert orjson.loads(content)["outputs"][0]["data"] == [1.0] * 16


# --- every refusal ------------------------------------------------------------------------------

FP32_X = {"name": "x", "datatype": "FP32", "shape": [1, 256]}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "request body is not valid JSON: unexpected end of data: line 1 column 2 (char 1)"),
        (
            b"[]",
            "request has value []; expected a JSON object {inputs, outputs?, id?, parameters?}",
        ),
        (
            b"{}",
            "inputs has value None; expected a non-empty list of tensors "
            "{name, datatype, shape, data}",
        ),
        (
            json_body([]),
            "inputs has value []; expected a non-empty list of tensors "
            "{name, datatype, shape, data}",
        ),
        (json_body([5]), "inputs[0] has value 5; expected a JSON object with a name"),
        (json_body([{"datatype": "FP32"}]), "inputs[0].name has value None; expected a string"),
        (
            json_body([x_input(name="w")]),
            "input 'w' is not an input of model 'mlp'; expected one of: x",
        ),
        (json_body([x_input(), x_input()]), "input 'x' is given twice; expected it once"),
        (json_body([x_input(datatype="FP64")]), "input 'x' has datatype FP64; expected FP32"),
        (json_body([x_input(datatype=None)]), "input 'x' has datatype None; expected FP32"),
        (
            json_body([x_input(datatype="BYTES")]),
            "input 'x' has datatype BYTES; expected FP32",
        ),
        (json_body([x_input(shape=[2, 255])]), "input 'x' has shape [2, 255]; expected [-1, 256]"),
        (json_body([x_input(shape=[256])]), "input 'x' has shape [256]; expected [-1, 256]"),
        (
            json_body([x_input(shape=[-1, 256])]),
            "input 'x' has shape [-1, 256]; expected [-1, 256]",
        ),
        (
            json_body([x_input(shape=[True, 256])]),
            "input 'x' has shape [True, 256]; expected [-1, 256]",
        ),
        (json_body([x_input(shape="1x256")]), "input 'x' has shape '1x256'; expected [-1, 256]"),
        (
            json_body([x_input(shape=[0, 256], data=[])]),
            "input 'x' has 0 rows (dimension 0); expected at least 1",
        ),
        (
            json_body([FP32_X]),
            "input 'x' has neither 'data' nor parameters.binary_data_size; expected one",
        ),
        (json_body([x_input(data=0.5)]), "input 'x' has data 0.5; expected a list"),
        (
            json_body([x_input(data=[0.5] * 255)]),
            "input 'x' has 255 data elements; its shape [1, 256] needs 256",
        ),
        (
            json_body([x_input(data=[[0.5] * 128] * 2)]),
            "input 'x' has data nested as [2, 128]; "
            "expected a flat list or lists nested as its shape [1, 256]",
        ),
        (
            json_body([x_input(data=[[0.5] * 256, [0.5]])]),
            "input 'x' has nested data of uneven "
            "lengths; expected a flat list or lists nested as its shape [1, 256]",
        ),
        (
            json_body([x_input(data=["0.5"] * 256)]),
            "input 'x' has data that are not all numbers; expected FP32 values",
        ),
        (
            json_body([x_input(data=[None] * 256)]),
            "input 'x' has data that are not all numbers; expected FP32 values",
        ),
        (
            json_body([x_input(data=[True] * 256)]),
            "input 'x' has data that are not all numbers; expected FP32 values",
        ),
        (
            json_body([x_input(data=[1e39] * 256)]),
            "input 'x' has values outside the range of FP32 [-3.40282e+38, 3.40282e+38]",
        ),
        (
            json_body([x_input(parameters=[])]),
            "input 'x' parameters has value []; expected a JSON object",
        ),
        (
            json_body([x_input(parameters={"shared_memory_region": "r"})]),
            "input 'x' uses shared memory, which batchserve does not support",
        ),
        (
            json_body([x_input(parameters={"binary_data_size": 1024})]),
            "input 'x' has both 'data' and parameters.binary_data_size; expected one",
        ),
        (
            json_body([{**FP32_X, "parameters": {"binary_data_size": 1024}}]),
            "input 'x' has "
            "parameters.binary_data_size, but the request has no Inference-Header-Content-Length "
            "header to delimit its binary data",
        ),
        (json_body([x_input()], id=7), "id has value 7; expected a string"),
        (json_body([x_input()], parameters=1), "parameters has value 1; expected a JSON object"),
        (
            json_body([x_input()], parameters={"timeout": -1}),
            "parameters.timeout has value -1; "
            "expected a non-negative integer number of microseconds",
        ),
        (
            json_body([x_input()], parameters={"timeout": 1.5}),
            "parameters.timeout has value "
            "1.5; expected a non-negative integer number of microseconds",
        ),
        (
            json_body([x_input()], parameters={"binary_data_output": "yes"}),
            "parameters.binary_data_output has value 'yes'; expected true or false",
        ),
        (
            json_body([x_input()], outputs={"y": {}}),
            "outputs has value {'y': {}}; expected a list of {name}",
        ),
        (
            json_body([x_input()], outputs=[{"name": "q"}]),
            "output 'q' is not an output of model 'mlp'; expected one of: y",
        ),
        (
            json_body([x_input()], outputs=[{"name": "y"}, {"name": "y"}]),
            "output 'y' is requested twice; expected it once",
        ),
        (
            json_body([x_input()], outputs=[{"name": "y", "parameters": {"classification": 3}}]),
            "output 'y' asks for classification or shared memory, which batchserve does not "
            "support",
        ),
        (
            json_body([x_input()], outputs=[{"name": "y", "parameters": {"binary_data": 1}}]),
            "output 'y' parameters.binary_data has value 1; expected true or false",
        ),
    ],
)
def test_json_refusals(body: bytes, message: str) -> None:
    with refused(message):
        decode_infer(body, None, MLP)


def multi_inputs(**overrides: dict[str, Any] | None) -> list[dict[str, Any]]:
    """MULTI's valid JSON inputs, with fields changed, or a whole input dropped by None."""
    inputs = {
        "a": {"name": "a", "datatype": "FP32", "shape": [2, 4], "data": [0.0] * 8},
        "b": {"name": "b", "datatype": "INT32", "shape": [2], "data": [1, 2]},
        "c": {"name": "c", "datatype": "BOOL", "shape": [2, 2], "data": [True] * 4},
    }
    for name, change in overrides.items():
        inputs[name] = {} if change is None else {**inputs[name], **change}
    return [tensor for tensor in inputs.values() if tensor]


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            multi_inputs(b={"data": [1.5, 2]}),
            "input 'b' has data that are not all integers; expected INT32 values",
        ),
        (
            multi_inputs(b={"data": [2**31, 0]}),
            "input 'b' has values outside the range of INT32 [-2.14748e+09, 2.14748e+09]",
        ),
        (
            # orjson reads integers beyond 64 bits as floats.
            multi_inputs(b={"data": [2**70, 0]}),
            "input 'b' has data that are not all integers; expected INT32 values",
        ),
        (
            multi_inputs(b={"data": [None, 0]}),
            "input 'b' has data that are not all integers; expected INT32 values",
        ),
        (
            multi_inputs(b={"data": [-1, 2**63]}),
            "input 'b' has values outside the range of INT32 [-2.14748e+09, 2.14748e+09]",
        ),
        (
            multi_inputs(c={"data": [True, None, 2**70, False]}),
            "input 'c' has data that are not all booleans (true/false); expected BOOL values",
        ),
        (
            multi_inputs(c={"data": [1, 0, 1, 0]}),
            "input 'c' has data that are not all booleans (true/false); expected BOOL values",
        ),
        (
            multi_inputs(c={"data": ["true"] * 4}),
            "input 'c' has data that are not all booleans (true/false); expected BOOL values",
        ),
        (
            multi_inputs(c=None),
            "input 'c' is missing; model 'multi' needs it as BOOL with shape [-1, 2]",
        ),
        (
            multi_inputs(b={"shape": [3], "data": [1, 2, 3]}),
            "input 'b' has 3 rows (dimension 0) "
            "but input 'a' has 2; expected the same batch size for all inputs",
        ),
    ],
)
def test_refusals_across_inputs(inputs: list[dict[str, Any]], message: str) -> None:
    with refused(message):
        decode_infer(json_body(inputs), None, MULTI)


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("UINT8", [-1, 0, 0], "input 'x' has values outside the range of UINT8 [0, 255]"),
        ("INT8", [128, 0, 0], "input 'x' has values outside the range of INT8 [-128, 127]"),
        (
            "INT64",
            [2**63, 0, 0],
            "input 'x' has values outside the range of INT64 [-9.22337e+18, 9.22337e+18]",
        ),
        ("FP16", [70000, 0, 0], "input 'x' has values outside the range of FP16 [-65504, 65504]"),
        ("FP16", [1e5, 0.5, 0], "input 'x' has values outside the range of FP16 [-65504, 65504]"),
        (
            "UINT64",
            [-1, 2**63, 0],
            "input 'x' has values outside the range of UINT64 [0, 1.84467e+19]",
        ),
        (
            "INT64",
            [-1, 2**63, 0],
            "input 'x' has values outside the range of INT64 [-9.22337e+18, 9.22337e+18]",
        ),
        (
            "FP32",
            [2.0**200, 0, 0],
            "input 'x' has values outside the range of FP32 [-3.40282e+38, 3.40282e+38]",
        ),
        # orjson reads integers beyond 64 bits as floats.
        (
            "UINT64",
            [2**64, 0, 0],
            "input 'x' has data that are not all integers; expected UINT64 values",
        ),
    ],
)
def test_range_refusals(datatype: str, data: list[Any], message: str) -> None:
    body = json_body([{"name": "x", "datatype": datatype, "shape": [1, 3], "data": data}])
    with refused(message):
        decode_infer(body, None, one(datatype))


@pytest.mark.parametrize(
    ("datatype", "data"),
    [
        ("UINT64", [2**64 - 1, 0, 1]),  # numpy alone would read this mix as float64
        ("INT64", [-(2**63), 2**63 - 1, 0]),
        ("FP32", [2**70, 0, -1]),  # beyond int64, yet a fine FP32
        ("FP16", [65504, -65504, 0.5]),
        # Each within FP32, their squares' sum past the limit's square: the exact check says.
        ("FP32", [1.5 * 2.0**127, -1.5 * 2.0**127, 1.5 * 2.0**127]),
    ],
)
def test_values_at_the_edge_of_a_range_are_exact(datatype: str, data: list[Any]) -> None:
    body = json_body([{"name": "x", "datatype": datatype, "shape": [1, 3], "data": data}])
    array = decode_infer(body, None, one(datatype)).inputs["x"]
    assert array.dtype == DATATYPES[datatype]
    assert array.tolist() == [data]


X_BINARY = {"inputs": [{**FP32_X, "parameters": {"binary_data_size": 1024}}]}
ROW = np.zeros(256, np.float32).tobytes()


@pytest.mark.parametrize(
    ("header", "blobs", "message"),
    [
        (
            X_BINARY,
            [ROW[:-4]],
            "input 'x' needs 1024 bytes of binary data at offset 0, but only 1020 remain",
        ),
        (
            X_BINARY,
            [ROW, b"\0"],
            "the request has 1025 bytes of binary data after its JSON header; its inputs use 1024",
        ),
        (
            {"inputs": [{**FP32_X, "parameters": {"binary_data_size": 1020}}]},
            [ROW[:-4]],
            "input 'x' has binary_data_size 1020; expected 1024 bytes for shape [1, 256] of FP32",
        ),
        (
            {"inputs": [{**FP32_X, "parameters": {"binary_data_size": "1024"}}]},
            [ROW],
            "input 'x' has binary_data_size '1024'; expected a byte count",
        ),
        (
            {"inputs": [x_input()]},
            [ROW],
            "the request has 1024 bytes of binary data after its JSON header; its inputs use 0",
        ),
    ],
)
def test_binary_refusals(header: dict[str, Any], blobs: list[bytes], message: str) -> None:
    body, length = binary_body(header, *blobs)
    with refused(message):
        decode_infer(body, length, MLP)


def test_binary_bool_must_be_zero_or_one() -> None:
    header = {
        "inputs": [
            {
                "name": "x",
                "datatype": "BOOL",
                "shape": [1, 3],
                "parameters": {"binary_data_size": 3},
            }
        ]
    }
    body, length = binary_body(header, b"\x01\x00\x02")
    with refused("input 'x' has BOOL bytes other than 0 and 1"):
        decode_infer(body, length, one("BOOL"))


def test_header_length_beyond_the_body() -> None:
    body, _ = binary_body(X_BINARY, ROW)
    message = f"Inference-Header-Content-Length is {len(body) + 1}; expected at most the body's "
    with refused(message + f"{len(body)} bytes"):
        decode_infer(body, len(body) + 1, MLP)
    with refused(
        f"Inference-Header-Content-Length is -1; expected at most the body's {len(body)} bytes"
    ):
        decode_infer(body, -1, MLP)


def test_header_length_cutting_the_json() -> None:
    body, length = binary_body(X_BINARY, ROW)
    with pytest.raises(BadRequest, match=r"^JSON header \(first 10 bytes\) is not valid JSON: "):
        decode_infer(body, 10, MLP)
    assert length > 10


def test_parse_header_length() -> None:
    assert parse_header_length(None) is None
    assert parse_header_length("120") == 120
    with refused("Inference-Header-Content-Length has value '-3'; expected a byte count"):
        parse_header_length("-3")
    with refused("Inference-Header-Content-Length has value 'abc'; expected a byte count"):
        parse_header_length("abc")
    with refused("Inference-Header-Content-Length has value '\xb2'; expected a byte count"):
        parse_header_length("\xb2")  # latin-1 superscript two: isdigit() alone would pass it


# --- encoding refusals: the model broke its own signature, so the server answers 500 ----------


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ({}, "model 'one' returned no output 'y'"),
        (
            {"y": np.zeros((1, 3), np.float64)},
            "model 'one' returned output 'y' as float64; its signature says INT64",
        ),
        (
            {"y": np.zeros((1, 2), np.int64)},
            "model 'one' returned output 'y' with shape [1, 2]; "
            "expected [-1, 3] with 1 rows in dimension 0",
        ),
        (
            {"y": np.zeros((2, 3), np.int64)},
            "model 'one' returned output 'y' with shape [2, 3]; "
            "expected [-1, 3] with 1 rows in dimension 0",
        ),
    ],
)
def test_encode_refusals(outputs: dict[str, np.ndarray], message: str) -> None:
    runner = one("INT64")
    body = json_body([{"name": "x", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}])
    request = decode_infer(body, None, runner)
    with pytest.raises(BatchserveError, match="^" + re.escape(message) + "$") as info:
        encode_infer("one", request, outputs, runner)
    assert info.value.status == 500


# --- metadata -----------------------------------------------------------------------------------


def test_model_metadata() -> None:
    assert orjson.loads(model_metadata(MULTI)) == {
        "name": "multi",
        "versions": ["1"],
        "platform": "batchserve",
        "inputs": [
            {"name": "a", "datatype": "FP32", "shape": [-1, 4]},
            {"name": "b", "datatype": "INT32", "shape": [-1]},
            {"name": "c", "datatype": "BOOL", "shape": [-1, 2]},
        ],
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [-1, 3]},
            {"name": "z", "datatype": "INT64", "shape": [-1]},
        ],
        "parameters": {"max_batch_size": 64, "input_batch_dim": 0, "output_batch_dim": 0},
    }


def test_model_metadata_names_the_batch_limit_and_batch_dimensions() -> None:
    runner = dataclasses.replace(one("FP32", 1), batching=Batching(max_batch_size=7))
    assert orjson.loads(model_metadata(runner))["parameters"] == {
        "max_batch_size": 7, "input_batch_dim": 1, "output_batch_dim": 1,
    }


def test_server_metadata() -> None:
    document = orjson.loads(server_metadata())
    assert document["name"] == "batchserve"
    assert document["extensions"] == ["binary_tensor_data"]
    assert isinstance(document["version"], str)


# --- BYTES tensors and non-batchable inputs -----------------------------------------------------

TEXT = RunnerConfig(
    name="text",
    model="models:text",
    inputs=(TensorSpec("text", "BYTES", (-1,)),
            TensorSpec("mode", "BYTES", (1,), batchable=False)),
    outputs=(TensorSpec("out", "BYTES", (-1,)),),
)


def prefixed(*items: bytes) -> bytes:
    """BYTES elements as the binary extension lays them out: a u32 LE length before each."""
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def bytes_input(name: str, shape: list[int], size: int) -> dict[str, Any]:
    return {"name": name, "datatype": "BYTES", "shape": shape,
            "parameters": {"binary_data_size": size}}


def test_bytes_in_binary_built_by_hand_are_bytes_objects() -> None:
    text = prefixed("naïve".encode(), b"", b"\xff\x00")
    mode = prefixed(b"lower")
    body, length = binary_body({"inputs": [bytes_input("text", [3], len(text)),
                                           bytes_input("mode", [1], len(mode))]}, text, mode)
    request = decode_infer(body, length, TEXT)
    assert request.inputs["text"].dtype == object
    assert request.inputs["text"].tolist() == ["naïve".encode(), b"", b"\xff\x00"]
    assert request.inputs["mode"].tolist() == [b"lower"]
    assert request.rows == 3  # counted on the batchable input only


def test_bytes_in_json_are_strings_flat_or_nested() -> None:
    body = json_body([{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["ü", ""]},
                      {"name": "mode", "datatype": "BYTES", "shape": [1], "data": ["x"]}])
    request = decode_infer(body, None, TEXT)
    assert request.inputs["text"].tolist() == ["ü".encode(), b""]
    nested = one("BYTES")
    body = json_body([{"name": "x", "datatype": "BYTES", "shape": [2, 3],
                       "data": [["a", "b", "c"], ["d", "e", "f"]]}])
    assert decode_infer(body, None, nested).inputs["x"][1].tolist() == [b"d", b"e", b"f"]


@pytest.mark.parametrize(
    ("text", "size", "message"),
    [
        (prefixed(b"ab") + b"\x05\x00", None,
         "input 'text' has BYTES binary data that end inside the length of element 1; its "
         "binary_data_size 8 holds 1 of the 2 elements"),
        (prefixed(b"ab") + (99).to_bytes(4, "little") + b"cd", None,
         "input 'text' has BYTES element 1 of 99 bytes, past the end of its binary data "
         "(2 bytes remain of binary_data_size 12)"),
        (prefixed(b"ab", b"cd") + b"!", None,
         "input 'text' has binary_data_size 13; its 2 BYTES elements for shape [2] use 12"),
        (prefixed(b"ab", b"cd"), 40,
         "input 'text' needs 40 bytes of binary data at offset 0, but only 17 remain"),
    ],
    ids=["truncated-length", "length-past-end", "bytes-left-over", "size-past-body"],
)
def test_malformed_binary_bytes_are_refused_by_name(
    text: bytes, size: int | None, message: str
) -> None:
    mode = prefixed(b"m")
    header = {"inputs": [bytes_input("text", [2], len(text) if size is None else size),
                         bytes_input("mode", [1], len(mode))]}
    body, length = binary_body(header, text, mode)
    with refused(message):
        decode_infer(body, length, TEXT)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (["a", 1], "input 'x' has data that are not all strings; expected BYTES values as "
                   "JSON strings"),
        ([["a"], "b"], "input 'x' has data that are not all strings; expected BYTES values as "
                       "JSON strings"),
        (["a", "b"], "input 'x' has 2 data elements; its shape [1, 3] needs 3"),
    ],
)
def test_json_bytes_refusals(data: list[Any], message: str) -> None:
    body = json_body([{"name": "x", "datatype": "BYTES", "shape": [1, 3], "data": data}])
    with refused(message):
        decode_infer(body, None, one("BYTES"))


def test_bytes_outputs_that_are_not_utf8_go_in_binary_only() -> None:
    runner = one("BYTES")
    body = json_body([{"name": "x", "datatype": "BYTES", "shape": [1, 3], "data": ["a"] * 3}])
    request = decode_infer(body, None, runner)
    y = np.array([[b"\xff", b"ok", b""]], dtype=object)
    with refused("output 'y' of model 'one' holds bytes that are not UTF-8, which JSON cannot "
                 "carry; ask for it with parameters.binary_data: true"):
        encode_infer("one", request, {"y": y}, runner)
    binary = dataclasses.replace(request, outputs=(RequestedOutput("y", True),))
    content, headers = encode_infer("one", binary, {"y": y}, runner)
    assert content.endswith(prefixed(b"\xff", b"ok", b""))
    assert triton_result(content, headers).as_numpy("y").tolist() == [[b"\xff", b"ok", b""]]


def test_a_numeric_output_for_a_bytes_signature_is_the_servers_bug() -> None:
    runner = one("BYTES")
    body = json_body([{"name": "x", "datatype": "BYTES", "shape": [1, 3], "data": ["a"] * 3}])
    request = decode_infer(body, None, runner)
    with pytest.raises(BatchserveError, match="returned output 'y' as float32"):
        encode_infer("one", request, {"y": np.zeros((1, 3), np.float32)}, runner)


def test_rows_disagreeing_on_a_non_batchable_input_do_not_matter() -> None:
    body = json_body([{"name": "text", "datatype": "BYTES", "shape": [4], "data": ["a"] * 4},
                      {"name": "mode", "datatype": "BYTES", "shape": [1], "data": ["m"]}])
    assert decode_infer(body, None, TEXT).rows == 4


def test_metadata_marks_non_batchable_inputs() -> None:
    assert orjson.loads(model_metadata(TEXT))["inputs"] == [
        {"name": "text", "datatype": "BYTES", "shape": [-1]},
        {"name": "mode", "datatype": "BYTES", "shape": [1], "parameters": {"batchable": False}},
    ]
