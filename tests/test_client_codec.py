"""The client's core without sockets: input checks, chunking, the codec against the server's own
codec, and which error answers are retried."""

from __future__ import annotations

import re
from email.utils import formatdate

import numpy as np
import orjson
import pytest

from batchserve.api import protocol
from batchserve.api.client.codec import (
    HEADER_LENGTH,
    ModelMetadata,
    ServerError,
    ServerUnavailable,
    TensorInfo,
    batch_rows,
    check_answer,
    check_inputs,
    decode_response,
    encode_request,
    join_chunks,
    retry_after,
    split_along,
    split_first_dim,
)
from batchserve.runner.core.config import RunnerConfig, TensorSpec

PAIR = ModelMetadata(
    name="pair",
    inputs=(TensorInfo("a", "FP32", (-1, 2)), TensorInfo("b", "INT32", (-1,))),
    outputs=(TensorInfo("y", "FP32", (-1, 2)),),
    max_batch_size=4,
)
PAIR_RUNNER = RunnerConfig(
    name="pair",
    model="models:pair",
    inputs=(TensorSpec("a", "FP32", (-1, 2)), TensorSpec("b", "INT32", (-1,))),
    outputs=(TensorSpec("y", "FP32", (-1, 2)),),
)


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


# --- metadata -----------------------------------------------------------------------------------


def test_metadata_is_read_from_the_servers_own_document() -> None:
    document = orjson.loads(protocol.model_metadata(PAIR_RUNNER))
    assert ModelMetadata.parse(document) == ModelMetadata(
        "pair", PAIR.inputs, PAIR.outputs, max_batch_size=64
    )


def test_metadata_without_parameters_means_no_limit() -> None:
    document = {"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}]}
    assert ModelMetadata.parse(document).max_batch_size is None


def test_metadata_that_is_not_v2_is_a_server_error() -> None:
    with pytest.raises(ServerError, match="the model metadata is not v2 metadata"):
        ModelMetadata.parse({"name": "m"})


# --- checking inputs ----------------------------------------------------------------------------


def test_inputs_by_position_and_by_name_come_back_in_the_models_order() -> None:
    a, b = np.zeros((3, 2), np.float32), np.zeros(3, np.int32)
    assert list(check_inputs(PAIR, [], {"b": b, "a": a})) == ["a", "b"]
    checked = check_inputs(PAIR, [a], {"b": b})
    assert checked["a"] is a and checked["b"] is b


def test_a_same_kind_dtype_is_cast_and_another_kind_refused() -> None:
    checked = check_inputs(PAIR, [np.zeros((1, 2)), np.zeros(1, np.int64)], {})
    assert checked["a"].dtype == np.float32 and checked["b"].dtype == np.int32
    with pytest.raises(ValueError, match=exactly(
        "input 'b' is an array of float64; expected INT32 (int32) or a type that casts to it "
        "without changing kind"
    )):
        check_inputs(PAIR, [np.zeros((1, 2)), np.zeros(1)], {})


@pytest.mark.parametrize(
    ("positional", "named", "message"),
    [
        ([[[1.0, 2.0]], np.zeros(1, np.int32)], {},
         "input 'a' is a list; expected a numpy array (np.asarray converts lists and most "
         "tensors)"),
        ([np.zeros((1, 2), np.float32)], {"b": 3},
         "input 'b' is a int; expected a numpy array (np.asarray converts lists and most "
         "tensors)"),
        ([np.zeros((1, 2), np.float32)], {}, "input 'b' of model 'pair' is missing"),
        ([], {"c": np.zeros(1)},
         "input 'c' is not an input of model 'pair'; expected one of: a, b"),
        ([np.zeros(1)] * 3, {}, "3 inputs given by position; model 'pair' has 2: a, b"),
        ([np.zeros((1, 2), np.float32)], {"a": np.zeros((1, 2), np.float32)},
         "input 'a' is given both by position and by name"),
    ],
)
def test_inputs_that_do_not_fit_the_model_are_named(
    positional: list[object], named: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=exactly(message)):
        check_inputs(PAIR, positional, named)


def test_first_dimensions_must_agree() -> None:
    inputs = {"a": np.zeros((5, 2)), "b": np.zeros(3)}
    with pytest.raises(ValueError, match=exactly(
        "input 'b' has 3 rows (dimension 0) but input 'a' has 5; expected the same batch size "
        "for all inputs"
    )):
        batch_rows(inputs)


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.float32(1.0).reshape(()), "input 'a' has 0 dimensions; expected a batch dimension 0"),
        (np.zeros((0, 2)), "input 'a' has 0 rows (dimension 0); expected at least 1"),
    ],
)
def test_an_input_without_rows_is_refused(array: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=exactly(message)):
        batch_rows({"a": array})


# --- chunking -----------------------------------------------------------------------------------


def test_the_default_strategy_slices_the_first_dimension_in_order() -> None:
    a = np.arange(20, dtype=np.float32).reshape(10, 2)
    b = np.arange(10, dtype=np.int32)
    chunks = list(split_first_dim({"a": a, "b": b}, 4))
    assert [len(chunk["b"]) for chunk in chunks] == [4, 4, 2]
    assert np.concatenate([chunk["b"] for chunk in chunks]).tolist() == b.tolist()
    np.testing.assert_array_equal(join_chunks(chunks, 0)["a"], a)


def test_a_strategy_along_another_axis() -> None:
    x = np.arange(14).reshape(2, 7)
    chunks = list(split_along(1)({"x": x}, 3))
    assert [chunk["x"].shape for chunk in chunks] == [(2, 3), (2, 3), (2, 1)]
    np.testing.assert_array_equal(join_chunks(chunks, 1)["x"], x)


def test_the_default_strategy_refuses_inconsistent_inputs() -> None:
    with pytest.raises(ValueError, match="input 'b' has 3 rows"):
        list(split_first_dim({"a": np.zeros((5, 2)), "b": np.zeros(3)}, 2))


# --- the codec against the server's own ---------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True])
def test_requests_decode_on_the_server(binary: bool) -> None:
    a = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
    b = np.array([7, -1, 2**31 - 1], np.int32)
    body, headers = encode_request({"a": a, "b": b}, PAIR, binary, 0.25)
    request = protocol.decode_infer(
        body, protocol.parse_header_length(headers.get(HEADER_LENGTH)), PAIR_RUNNER
    )
    np.testing.assert_array_equal(request.inputs["a"], a)
    np.testing.assert_array_equal(request.inputs["b"], b)
    assert request.timeout_s == 0.25
    assert request.outputs == (protocol.RequestedOutput("y", binary),)


@pytest.mark.parametrize("binary", [False, True])
def test_answers_from_the_server_decode(binary: bool) -> None:
    a = np.ones((2, 2), np.float32)
    body, headers = encode_request({"a": a, "b": np.ones(2, np.int32)}, PAIR, binary, 1.0)
    request = protocol.decode_infer(
        body, protocol.parse_header_length(headers.get(HEADER_LENGTH)), PAIR_RUNNER
    )
    y = np.array([[1.5, -2.0], [3.25, 0.0]], np.float32)
    content, answer_headers = protocol.encode_infer("pair", request, {"y": y}, PAIR_RUNNER)
    outputs = decode_response(answer_headers, content)
    np.testing.assert_array_equal(outputs["y"], y)
    assert outputs["y"].dtype == np.float32 and outputs["y"].flags.writeable


def test_a_truncated_binary_answer_is_a_server_error() -> None:
    header = orjson.dumps({"outputs": [{"name": "y", "datatype": "FP32", "shape": [2, 2],
                                        "parameters": {"binary_data_size": 16}}]})
    with pytest.raises(ServerError, match="the answer is not a v2 inference response"):
        decode_response({HEADER_LENGTH: str(len(header))}, header + b"\0" * 8)


# --- error answers and retries ------------------------------------------------------------------


def error(message: str) -> bytes:
    return orjson.dumps({"error": message})


def test_a_success_is_not_retried() -> None:
    assert check_answer(200, {}, b"{}", 1.0) is None


def test_a_503_with_retry_after_within_the_deadline_is_retried_after_it() -> None:
    assert check_answer(503, {"Retry-After": "2"}, error("busy"), 2.5) == 2.0


def test_a_503_whose_wait_would_pass_the_deadline_is_raised() -> None:
    with pytest.raises(ServerUnavailable, match=exactly(
        "the server answered 503: busy (retrying after 2 s would pass the deadline, 1.5 s away)"
    )) as info:
        check_answer(503, {"Retry-After": "2"}, error("busy"), 1.5)
    assert info.value.status == 503 and info.value.retry_after_s == 2.0
    assert info.value.message == "busy"


def test_a_503_without_retry_after_is_raised() -> None:
    with pytest.raises(ServerUnavailable, match=exactly(
        "the server answered 503: busy (no Retry-After: not retried)"
    )):
        check_answer(503, {}, error("busy"), 10.0)


def test_a_503_tells_the_reason_its_body_names() -> None:
    body = orjson.dumps({"error": "busy", "reason": "front", "lag_ms": 212.0})
    with pytest.raises(ServerUnavailable) as info:
        check_answer(503, {"Retry-After": "1"}, body, 0.5)
    assert info.value.reason == "front" and info.value.message == "busy"
    with pytest.raises(ServerUnavailable) as plain:  # a server that names none
        check_answer(503, {}, error("busy"), 10.0)
    assert plain.value.reason is None
    with pytest.raises(ServerUnavailable) as foreign:  # not JSON, or not an object
        check_answer(503, {}, b"[1, 2]", 10.0)
    assert foreign.value.reason is None and foreign.value.message == "[1, 2]"


def test_other_errors_carry_the_servers_status_and_message() -> None:
    with pytest.raises(ServerError, match=exactly("the server answered 400: bad shape")) as info:
        check_answer(400, {}, error("bad shape"), 10.0)
    assert info.value.status == 400 and info.value.message == "bad shape"
    with pytest.raises(ServerError, match=exactly("the server answered 502: Bad Gateway")):
        check_answer(502, {}, b"Bad Gateway", 10.0)


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert retry_after("3") == 3.0
    assert retry_after(formatdate(1000.0 + 4, usegmt=True), now=lambda: 1000.0) == 4.0
    assert retry_after(formatdate(1000.0 - 4, usegmt=True), now=lambda: 1000.0) == 0.0
    assert retry_after("soon") is None
    assert retry_after(None) is None
