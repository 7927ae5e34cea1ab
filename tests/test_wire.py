"""The wire format: exact round trips, any split of the stream, and refusal of bad frames."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from batchserve.runner.types import DATATYPES
from batchserve.runner.wire import (
    STAGE_BYTES,
    Address,
    Call,
    Failure,
    FailureCode,
    FrameReader,
    Ping,
    Pong,
    Result,
    WireError,
    decode,
    encode,
)


def frame_bytes(message: object) -> bytes:
    return b"".join(bytes(chunk) for chunk in encode(message))  # type: ignore[arg-type]


def round_trip(message: object) -> object:
    (body,) = list(FrameReader().feed(frame_bytes(message)))
    return decode(body)


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_every_datatype_round_trips_exactly(datatype: str) -> None:
    dtype = DATATYPES[datatype]
    array = (np.arange(24) % 2 if dtype.kind == "b" else np.arange(24)).astype(dtype)
    array = array.reshape(2, 3, 4)
    call = round_trip(Call(7, 0.25, 2, {"t": array, "scalar": np.array(3, dtype=dtype)}))
    assert isinstance(call, Call)
    assert (call.id, call.budget_s, call.rows) == (7, 0.25, 2)
    np.testing.assert_array_equal(call.tensors["t"], array)
    assert call.tensors["t"].dtype == dtype and call.tensors["scalar"].shape == ()


def test_tensor_data_is_aligned_and_writable() -> None:
    result = round_trip(Result(1, {"odd_name": np.ones((3, 5), np.float64)}))
    assert isinstance(result, Result)
    array = result.tensors["odd_name"]
    assert array.ctypes.data % 8 == 0
    array[0, 0] = 2.0  # torch.from_numpy needs writable memory


def test_non_contiguous_arrays_are_sent_in_row_major_order() -> None:
    array = np.arange(12, dtype=np.int32).reshape(3, 4).T
    result = round_trip(Result(2, {"t": array}))
    assert isinstance(result, Result)
    np.testing.assert_array_equal(result.tensors["t"], array)


def test_failures_and_pings_round_trip() -> None:
    failure = Failure(9, FailureCode.REFUSED, "too late: ünïcode", 0.5)
    assert round_trip(failure) == failure
    assert round_trip(Ping(3)) == Ping(3)
    assert round_trip(Pong(4)) == Pong(4)


def test_frames_survive_any_split_of_the_stream() -> None:
    # Small frames, then one larger than the staging buffer, then small ones again.
    rows = [1, 2, 3, STAGE_BYTES // 4, 4, 5]
    messages = [Call(i, 1.0, n, {"x": np.full((n, 2), i, np.float32)}) for i, n in enumerate(rows)]
    stream = b"".join(frame_bytes(m) for m in messages)
    for step in (1, 3, 7, 64, 5000, STAGE_BYTES + 1, len(stream)):
        reader = FrameReader()
        got = [decode(body) for i in range(0, len(stream), step)
               for body in reader.feed(stream[i : i + step])]
        assert [m.id for m in got] == list(range(len(rows)))  # type: ignore[union-attr]
        for sent, received in zip(messages, got, strict=True):
            np.testing.assert_array_equal(received.tensors["x"], sent.tensors["x"])  # type: ignore[union-attr]


def test_a_frame_larger_than_the_stage_is_read_into_its_own_body_in_place() -> None:
    big = Call(7, 1.0, STAGE_BYTES, {"x": np.arange(STAGE_BYTES, dtype=np.float32)})
    frame = frame_bytes(big)
    reader = FrameReader()
    assert reader.feed(frame[:1000]) == []
    rest = reader.get_buffer()
    assert len(rest) == len(frame) - 1000  # the body's own remaining bytes, nothing staged
    rest[:] = frame[1000:]
    (body,) = reader.buffer_updated(len(rest))
    assert rest.obj is body  # the socket's bytes landed in the body: no copy after
    tensor = decode(body).tensors["x"]  # type: ignore[union-attr]
    assert np.shares_memory(tensor, np.frombuffer(body, np.uint8))
    np.testing.assert_array_equal(tensor, big.tensors["x"])


def test_a_tensor_that_overruns_its_frame_is_refused() -> None:
    body = bytearray(frame_bytes(Call(1, 1.0, 2, {"x": np.ones((2, 2), np.float32)}))[4:])
    with pytest.raises(WireError, match="overruns its frame"):
        decode(body[:-4])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (struct.pack("<BQ", 99, 1), "unknown frame kind 99"),
        (b"\x01", "malformed frame"),
        (struct.pack("<BQdIH", 1, 1, 1.0, 1, 1) + b"\x01x\x63\x01" + b"\0" * 16, "unknown dtype"),
    ],
)
def test_malformed_frames_raise_wire_errors(body: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode(bytearray(body))


def test_a_frame_announcing_more_than_the_limit_is_refused() -> None:
    with pytest.raises(WireError, match="over the wire's limit"):
        list(FrameReader().feed(struct.pack("<I", 0xFFFFFFFF)))


def test_addresses_parse_unix_and_tcp() -> None:
    assert str(Address.parse("unix:/tmp/a.sock")) == "unix:/tmp/a.sock"
    assert Address.parse("tcp:10.0.0.2:7000").target == "10.0.0.2:7000"
    for bad in ("/tmp/a.sock", "tcp:host", "udp:x:1", "unix:"):
        with pytest.raises(ValueError, match="must look like"):
            Address.parse(bad)
