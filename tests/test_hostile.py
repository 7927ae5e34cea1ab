"""Hostile input: whatever a client sends, the answer is a 4xx naming what is wrong, never a
crash or a 5xx. Property-based, over the v2 request format, JSON and binary."""

from __future__ import annotations

import json
import re
import struct
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from batchserve.api.errors import BadRequest, BatchserveError
from batchserve.api.protocol import decode_infer, parse_header_length
from batchserve.runner.core.config import RunnerConfig, TensorSpec
from batchserve.runner.core.types import DATATYPES

RUNNER = RunnerConfig(
    name="multi",
    model="models:multi",
    inputs=(TensorSpec("a", "FP32", (-1, 4)), TensorSpec("b", "INT32", (-1,)),
            TensorSpec("c", "BOOL", (-1, 2))),
    outputs=(TensorSpec("y", "FP32", (-1, 3)),),
)
SETTINGS = settings(max_examples=400, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=5),
    max_leaves=30,
)
names = st.sampled_from(["a", "b", "c", "d", "", "a" * 300])
datatypes = st.sampled_from([*DATATYPES, "BYTES", "FP8", "", "fp32"])
shapes = st.lists(st.integers(-3, 2**40), max_size=4) | json_values


@st.composite
def tensor(draw: st.DrawFn) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": draw(names), "datatype": draw(datatypes),
                             "shape": draw(shapes)}
    if draw(st.booleans()):
        entry["data"] = draw(json_values)
    if draw(st.booleans()):
        entry["parameters"] = draw(st.dictionaries(
            st.sampled_from(["binary_data_size", "binary_data", "x"]),
            st.integers(-5, 2**50) | json_values, max_size=2))
    return entry


requests = st.fixed_dictionaries(
    {"inputs": st.lists(tensor(), max_size=4) | json_values},
    optional={"outputs": json_values, "parameters": json_values, "id": json_values},
)


def answer(body: bytes, header: str | None) -> None:
    """Decoding either succeeds or raises one of ours: a 4xx with a message."""
    try:
        decode_infer(body, parse_header_length(header), RUNNER)
    except BatchserveError as exc:
        assert 400 <= exc.status < 500, exc
        assert exc.message


@SETTINGS
@given(requests)
def test_any_json_request_is_decoded_or_refused_with_a_4xx(document: dict[str, Any]) -> None:
    answer(json.dumps(document).encode(), None)


VALID = orjson.dumps({"inputs": [
    {"name": "a", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
    {"name": "b", "datatype": "INT32", "shape": [1], "data": [7]},
    {"name": "c", "datatype": "BOOL", "shape": [1, 2], "data": [True, False]},
]})


def what_is_wrong(body: bytes) -> str:
    """The start of the message refusing `body`: what it gets wrong, judged here apart from
    the decoder. A JSON object is refused at its inputs (or at parameters, read first): bytes
    drawn at random never hold the three tensors the runner takes."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "request body is not valid JSON: "
    if not isinstance(document, dict):
        return "request has value "
    return "input" if "parameters" not in document else "(input|parameters)"


@SETTINGS
@example(b"")
@example(b"{")
@example(b"\xff\xfe{}")
@example(b"nul")
@example(b"0")
@example(b"[]")
@example(b'"inputs"')
@example(b"{}")
@example(b'{"inputs": 1}')
@example(b'{"parameters": 1}')
@given(st.binary(max_size=512))
def test_any_bytes_as_a_json_body_are_refused_with_a_4xx(body: bytes) -> None:
    assume(body != VALID)
    valid = decode_infer(VALID, None, RUNNER)  # a decoder refusing everything fails here
    assert valid.inputs["b"].tolist() == [7] and valid.rows == 1
    with pytest.raises(BadRequest) as refused:
        decode_infer(body, None, RUNNER)
    assert 400 <= refused.value.status < 500
    assert re.match(what_is_wrong(body), refused.value.message), refused.value.message


@SETTINGS
@given(requests, st.binary(max_size=256), st.integers(-10, 600) | st.text(max_size=6))
def test_any_binary_extension_body_is_decoded_or_refused_with_a_4xx(
    document: dict[str, Any], blob: bytes, header_length: int | str
) -> None:
    head = json.dumps(document).encode()
    header = str(header_length) if isinstance(header_length, int) else header_length
    if isinstance(header_length, int) and header_length == -1:
        header = str(len(head))  # the well-formed case, with random blobs after it
    answer(head + blob, header)


@SETTINGS
@given(st.integers(1, 8), st.data())
def test_well_formed_binary_requests_decode_to_the_declared_shapes(
    rows: int, data: st.DataObject
) -> None:
    a = data.draw(st.lists(st.floats(width=32, allow_nan=False), min_size=4 * rows,
                           max_size=4 * rows))
    b = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=rows, max_size=rows))
    c = data.draw(st.lists(st.booleans(), min_size=2 * rows, max_size=2 * rows))
    blobs = [struct.pack(f"<{len(a)}f", *a), struct.pack(f"<{len(b)}i", *b), bytes(c)]
    document = {"inputs": [
        {"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(blob)}}
        for (n, d, s), blob in zip(
            [("a", "FP32", [rows, 4]), ("b", "INT32", [rows]), ("c", "BOOL", [rows, 2])],
            blobs, strict=True)
    ]}
    head = orjson.dumps(document)
    call = decode_infer(head + b"".join(blobs), len(head), RUNNER)
    assert call.inputs["a"].shape == (rows, 4) and call.inputs["b"].tolist() == b
    assert call.inputs["c"].tolist() == [c[i:i + 2] for i in range(0, 2 * rows, 2)]


FINITE = RunnerConfig(
    name="finite", model="models:finite",
    inputs=(TensorSpec("x", "FP32", (-1, 2), finite=True),),
    outputs=(TensorSpec("y", "FP32", (-1, 2)),),
)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_runner_that_takes_finite_values_only_refuses_nan_and_infinity(value: float) -> None:
    blob = np.array([[1.0, value]], dtype=np.float32).tobytes()
    head = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                     "parameters": {"binary_data_size": len(blob)}}]})
    with pytest.raises(BadRequest, match=r"^input 'x' holds NaN or infinity; model 'finite' "
                                         r"takes finite values only$"):
        decode_infer(head + blob, len(head), FINITE)
    overflow = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"data":[1,1e39]}]}'
    with pytest.raises(BadRequest):
        decode_infer(overflow, None, FINITE)  # beyond FP32: refused, one way or the other
    fine = np.array([[1.0, 2.0]], dtype=np.float32).tobytes()
    assert decode_infer(head + fine, len(head), FINITE).inputs["x"].tolist() == [[1.0, 2.0]]
