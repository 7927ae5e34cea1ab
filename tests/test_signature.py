"""The one signature check the API and the runners share: every refusal, word for word."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from batchserve.api.dispatch import Link
from batchserve.api.errors import BadRequest
from batchserve.api.protocol import decode_infer
from batchserve.runner.core.config import RunnerConfig, TensorSpec, parse
from batchserve.runner.core.signature import Signature, SignatureError, fits, shape_text, show
from batchserve.runner.core.wire import Address, Call, Failure, FailureCode, Result
from batchserve.runner.server import Connection
from tests.test_dispatcher import RUNNER, Gate, dispatcher

MULTI = Signature(RunnerConfig(
    name="multi",
    model="models:multi",
    inputs=(
        TensorSpec("a", "FP32", (-1, 4)),
        TensorSpec("b", "INT32", (-1,)),
        TensorSpec("c", "BOOL", (-1, 2)),
    ),
    outputs=(TensorSpec("y", "FP32", (-1, 3)),),
))
FINITE = Signature(RunnerConfig(
    name="finite",
    model="models:finite",
    inputs=(TensorSpec("x", "FP64", (2, -1), finite=True),),
    outputs=(TensorSpec("y", "FP64", (2, -1)),),
    batch_dim=(1, 1),
))

TEXT = Signature(RunnerConfig(
    name="text",
    model="models:text",
    inputs=(
        TensorSpec("text", "BYTES", (-1,)),
        TensorSpec("mode", "BYTES", (1,), batchable=False),
        TensorSpec("scale", "FP32", (3,), batchable=False),
    ),
    outputs=(TensorSpec("y", "BYTES", (-1,)),),
))


def refused(message: str) -> Any:
    return pytest.raises(SignatureError, match="^" + re.escape(message) + "$")


def call(rows: int = 2, **changes: np.ndarray | None) -> dict[str, np.ndarray]:
    """MULTI's inputs for `rows` rows, with arrays replaced, or dropped by None."""
    tensors: dict[str, np.ndarray | None] = {
        "a": np.zeros((rows, 4), np.float32),
        "b": np.arange(rows, dtype=np.int32),
        "c": np.ones((rows, 2), bool),
        **changes,
    }
    return {name: array for name, array in tensors.items() if array is not None}


def test_a_call_that_fits_passes_and_its_rows_are_counted() -> None:
    MULTI.check(call(3), 3)
    assert MULTI.rows(call(3)) == 3
    FINITE.check({"x": np.ones((2, 5))}, 5)  # batched on dimension 1
    assert FINITE.rows({"x": np.ones((2, 5))}) == 5


@pytest.mark.parametrize(
    ("tensors", "rows", "message"),
    [
        (
            call(d=np.zeros(2)),
            2,
            "input 'd' is not an input of model 'multi'; expected one of: a, b, c",
        ),
        (call(b=None), 2, "input 'b' is missing; model 'multi' needs it as INT32 with shape [-1]"),
        (call(a=np.zeros((2, 4))), 2, "input 'a' has datatype FP64; expected FP32"),
        (call(b=np.zeros(2, np.uint32)), 2, "input 'b' has datatype UINT32; expected INT32"),
        (call(a=np.zeros((2, 3), np.float32)), 2, "input 'a' has shape [2, 3]; expected [-1, 4]"),
        (call(a=np.zeros((2, 4, 1), np.float32)), 2,
         "input 'a' has shape [2, 4, 1]; expected [-1, 4]"),
        (call(a=np.zeros(4, np.float32)), 2, "input 'a' has shape [4]; expected [-1, 4]"),
        (call(0), 0, "input 'a' has 0 rows (dimension 0); expected at least 1"),
        (
            call(b=np.arange(3, dtype=np.int32)),
            2,
            "input 'b' has 3 rows (dimension 0) but input 'a' has 2; "
            "expected the same batch size for all inputs",
        ),
        (call(2), 3, "the call says it has 3 rows, but its inputs have 2 (dimension 0)"),
    ],
)
def test_the_runners_check_refuses_with_the_apis_words(
    tensors: dict[str, np.ndarray], rows: int, message: str
) -> None:
    with refused(message):
        MULTI.check(tensors, rows)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_an_input_that_takes_finite_values_only_refuses_nan_and_infinity(value: float) -> None:
    with refused("input 'x' holds NaN or infinity; model 'finite' takes finite values only"):
        FINITE.check({"x": np.array([[1.0, value], [0.0, 0.0]])}, 2)
    MULTI.check(call(a=np.full((2, 4), np.nan, np.float32)), 2)  # no such promise: passes


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ("FP64", "input 'a' has datatype FP64; expected FP32"),
        (None, "input 'a' has datatype None; expected FP32"),
        ("BYTES", "input 'a' has datatype BYTES; expected FP32"),
        (["FP32"], "input 'a' has datatype ['FP32']; expected FP32"),
    ],
)
def test_a_declared_datatype_is_checked_as_the_api_reads_it(declared: Any, message: str) -> None:
    MULTI.check_datatype(MULTI.spec("a"), "FP32")
    with refused(message):
        MULTI.check_datatype(MULTI.spec("a"), declared)


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ([3, 5], "input 'a' has shape [3, 5]; expected [-1, 4]"),
        ([-1, 4], "input 'a' has shape [-1, 4]; expected [-1, 4]"),
        ([True, 4], "input 'a' has shape [True, 4]; expected [-1, 4]"),
        ([1.0, 4], "input 'a' has shape [1.0, 4]; expected [-1, 4]"),
        ("3x4", "input 'a' has shape '3x4'; expected [-1, 4]"),
        (None, "input 'a' has shape None; expected [-1, 4]"),
    ],
)
def test_a_declared_shape_is_checked_as_the_api_reads_it(declared: Any, message: str) -> None:
    assert MULTI.check_shape(MULTI.spec("a"), [3, 4]) == (3, 4)
    assert MULTI.check_shape(MULTI.spec("a"), (0, 4)) == (0, 4)  # rows are counted apart
    with refused(message):
        MULTI.check_shape(MULTI.spec("a"), declared)


def test_the_words_of_error_messages() -> None:
    assert shape_text((2, -1)) == "[2, -1]" and shape_text([]) == "[]"
    assert show("x") == "'x'"
    assert show(list(range(100))) == repr(list(range(100)))[:57] + "..."
    assert fits((5, 4), (-1, 4)) and fits([1], (1,))
    assert not fits((5, 4), (-1, 3)) and not fits((5,), (-1, 4))



def test_the_api_refuses_with_the_same_words_as_a_runner() -> None:
    body = (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [2, 3], '
            b'"data": [0, 0, 0, 0, 0, 0]}]}')
    runner = RunnerConfig(name="multi", model="models:multi", inputs=tuple(MULTI.specs.values()),
                          outputs=(TensorSpec("y", "FP32", (-1, 3)),))
    with pytest.raises(BadRequest, match=r"^input 'a' has shape \[2, 3\]; expected \[-1, 4\]$"):
        decode_infer(body, None, runner)
    with refused("input 'a' has shape [2, 3]; expected [-1, 4]"):
        MULTI.check(call(a=np.zeros((2, 3), np.float32)), 2)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_runner_refuses_a_call_that_disagrees_with_its_signature(tmp_path: Path) -> None:
    """Over the wire, as any client would reach it: the same check, an INVALID failure."""
    d = dispatcher(Gate())
    await d.start()
    address = Address.parse(f"unix:{tmp_path / 'runner.sock'}")
    server = await address.serve(lambda: Connection(RUNNER, d, set()))
    link = Link(RUNNER.name, address)
    await address.connect(lambda: link)
    async with asyncio.timeout(30):  # the handshake comes first
        await link.greeted.wait()
    try:
        x = np.ones((2, 2), np.float32)
        answers = [
            await link.call(lambda ident, rows=rows, tensors=tensors: Call(ident, 1.0, rows,
                                                                            tensors))
            for rows, tensors in [(2, {"x": x.astype(np.float64)}), (3, {"x": x}),
                                  (2, {"x": x, "z": x}), (2, {"x": x})]
        ]
    finally:
        if link.transport is not None:
            link.transport.close()
        server.close()
    assert answers[:3] == [
        Failure(answers[0].id, FailureCode.INVALID, "input 'x' has datatype FP64; expected FP32"),
        Failure(answers[1].id, FailureCode.INVALID,
                "the call says it has 3 rows, but its inputs have 2 (dimension 0)"),
        Failure(answers[2].id, FailureCode.INVALID,
                "input 'z' is not an input of model 'double'; expected one of: x"),
    ]
    assert isinstance(answers[3], Result)
    np.testing.assert_array_equal(answers[3].tensors["y"], x * 2)


def texts(rows: int, **changes: np.ndarray) -> dict[str, np.ndarray]:
    return {"text": np.array([b"x"] * rows, object), "mode": np.array([b"m"], object),
            "scale": np.ones(3, np.float32), **changes}


def test_non_batchable_inputs_have_no_batch_dimension_and_do_not_count_rows() -> None:
    TEXT.check(texts(5), 5)
    assert TEXT.rows(texts(5)) == 5
    assert TEXT.rows(texts(1)) == 1  # "scale" has 3 elements, but it is not batched


@pytest.mark.parametrize(
    ("tensors", "rows", "message"),
    [
        (texts(2), 3, "the call says it has 3 rows, but its inputs have 2 (dimension 0)"),
        (texts(2, mode=np.array([b"a", b"b"], object)), 2,
         "input 'mode' has shape [2]; expected [1]"),
        (texts(2, text=np.array(["a", "b"], object)), 2,
         "input 'text' holds a str element; expected bytes in every element of a BYTES tensor"),
        (texts(2, text=np.array([b"a", b"b"])), 2,
         f"input 'text' has datatype {np.dtype('S1')}; expected BYTES"),
        (texts(2, scale=np.ones(3, object)), 2, "input 'scale' has datatype BYTES; expected FP32"),
    ],
)
def test_bytes_and_non_batchable_inputs_are_checked_like_any_other(
    tensors: dict[str, np.ndarray], rows: int, message: str
) -> None:
    with refused(message):
        TEXT.check(tensors, rows)


# --- ragged and pad inputs: a request is one sequence, one row, weighed in elements ---------


def sequences(layout: str) -> Signature:
    spec = ({"ragged": True} if layout == "ragged" else {"pad": {"value": 0}})
    return Signature(parse({"runners": {"seq": {
        "model": "models:seq",
        "batching": {"max_batch_size": 4, "max_batch_elements": 10},
        "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [-1], **spec},
                   {"name": "weights", "datatype": "FP32", "shape": [-1], **spec}],
        "batch_inputs": [{"kind": "element_count", "name": "n", "source": "tokens"},
                         {"kind": "element_count", "name": "m", "source": "weights"}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }}}).runners["seq"])


def sequence(tokens: int, weights: int) -> dict[str, np.ndarray]:
    return {"tokens": np.zeros(tokens, np.int64), "weights": np.ones(weights, np.float32)}


@pytest.mark.parametrize("layout", ["ragged", "pad"])
def test_a_sequence_is_one_row_whatever_its_length_and_costs_its_elements(layout: str) -> None:
    seq = sequences(layout)
    for length in (1, 7, 10):
        seq.check(sequence(length, length), 1)
        assert seq.rows(sequence(length, length)) == 1
        assert seq.cost(sequence(length, length), 1) == length
    assert seq.cost(sequence(3, 8), 1) == 8  # the longest input
    assert MULTI.cost(call(3), 3) == 3  # rows, for a runner that batches rows


@pytest.mark.parametrize("layout", ["ragged", "pad"])
@pytest.mark.parametrize(
    ("tensors", "rows", "message"),
    [
        (sequence(0, 2), 1,
         "input 'tokens' has 0 elements; a {layout} input expects a sequence of at least 1"),
        (sequence(2, 11), 1,
         "input 'weights' has 11 elements; model 'seq' takes at most 10 in a batch "
         "(its max_batch_elements), and a request is never split"),
        (sequence(5, 5), 5, "the call says it has 5 rows, but its inputs have 1 (dimension 0)"),
        ({"tokens": np.zeros((1, 3), np.int64), "weights": np.ones(3, np.float32)}, 1,
         "input 'tokens' has shape [1, 3]; expected [-1]"),
        ({**sequence(2, 2), "n": np.array([2])}, 1,
         "input 'n' is not an input of model 'seq'; expected one of: tokens, weights"),
    ],
)
def test_a_sequence_the_runner_cannot_take_is_refused_by_the_one_check(
    layout: str, tensors: dict[str, np.ndarray], rows: int, message: str
) -> None:
    """The batch inputs are the runner's to make: a caller cannot send them."""
    with refused(message.format(layout=layout)):
        sequences(layout).check(tensors, rows)


def test_the_api_counts_a_sequence_as_one_row_by_the_same_check() -> None:
    runner = parse({"runners": {"seq": {
        "model": "models:seq",
        "batching": {"max_batch_elements": 10},
        "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [-1], "ragged": True}],
        "batch_inputs": [{"kind": "accumulated_element_count", "name": "ends",
                          "source": "tokens"}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }}}).runners["seq"]

    def body(length: int) -> bytes:
        return orjson.dumps({"inputs": [{"name": "tokens", "datatype": "INT64",
                                          "shape": [length], "data": [1] * length}]})

    assert decode_infer(body(10), None, runner).rows == 1
    with pytest.raises(BadRequest, match=r"^input 'tokens' has 11 elements; model 'seq' takes "
                       r"at most 10 in a batch \(its max_batch_elements\), and a request is "
                       r"never split$"):
        decode_infer(body(11), None, runner)
