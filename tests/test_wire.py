"""The wire format: exact round trips, any split of the stream, and refusal of bad frames."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from batchserve.runner.core.types import DATATYPES
from batchserve.runner.core.wire import (
    STAGE_BYTES,
    Address,
    Backlog,
    Call,
    Failure,
    FailureCode,
    FrameReader,
    Ping,
    Pong,
    Result,
    Results,
    WireError,
    batched,
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
    if datatype == "BYTES":
        items = [b"", b"\0", "naïve".encode(), b"\xff\xfe", b"x" * 70_000] * 5
        array = np.array(items[:24], dtype=object)
        scalar = np.array(b"three", dtype=object)
    else:
        array = (np.arange(24) % 2 if dtype.kind == "b" else np.arange(24)).astype(dtype)
        scalar = np.array(3, dtype=dtype)
    array = array.reshape(2, 3, 4)
    call = round_trip(Call(7, 0.25, 2, {"t": array, "scalar": scalar, "after": array[:1]}))
    assert isinstance(call, Call)
    assert (call.id, call.budget_s, call.rows) == (7, 0.25, 2)
    np.testing.assert_array_equal(call.tensors["t"], array)
    np.testing.assert_array_equal(call.tensors["after"], array[:1])
    assert call.tensors["scalar"] == scalar
    assert call.tensors["t"].dtype == dtype and call.tensors["scalar"].shape == ()


def test_tensor_data_is_aligned_and_writable() -> None:
    result = round_trip(Result(1, {"odd_name": np.ones((3, 5), np.float64)}, 0.0))
    assert isinstance(result, Result)
    array = result.tensors["odd_name"]
    assert array.ctypes.data % 8 == 0
    array[0, 0] = 2.0  # torch.from_numpy needs writable memory


def test_a_result_says_how_long_before_its_deadline_its_batch_ended() -> None:
    for spare_s in (0.0123, -0.004):  # early, and late
        result = round_trip(Result(4, {"y": np.ones(2, np.float32)}, spare_s))
        assert isinstance(result, Result) and result.spare_s == spare_s
        assert result.tensors["y"].ctypes.data % 8 == 0  # still aligned behind the longer head


def test_a_batchs_answers_travel_in_one_frame_and_come_back_as_they_went() -> None:
    # What a batch of three requests (2, 1 and 3 rows) answers: views of its outputs, with a
    # ragged output of any length per request and BYTES beside them.
    y = np.arange(24, dtype=np.float32).reshape(6, 4)
    words = np.array([b"a", b"", b"ccc", "ü".encode(), b"e", b"f"], dtype=object)
    ragged = [np.arange(n, dtype=np.int64) for n in (3, 0, 5)]
    answers = [Result(ident, {"y": y[start:end], "w": words[start:end], "ids": ids}, spare)
               for ident, start, end, ids, spare in ((11, 0, 2, ragged[0], 0.01),
                                                     (12, 2, 3, ragged[1], -0.002),
                                                     (13, 3, 6, ragged[2], 0.0))]
    (frame,) = batched(answers, 0)
    assert isinstance(frame, Results) and frame.lengths == ((2, 1, 3), (2, 1, 3), (3, 0, 5))
    read = round_trip(frame)
    assert isinstance(read, Results)
    back = read.answers()
    assert [(a.id, a.spare_s) for a in back] == [(11, 0.01), (12, -0.002), (13, 0.0)]
    for sent, got in zip(answers, back, strict=True):
        assert list(got.tensors) == ["y", "w", "ids"]
        for name, array in sent.tensors.items():
            np.testing.assert_array_equal(got.tensors[name], array)
            assert got.tensors[name].dtype == array.dtype
    assert back[0].tensors["y"].base is not None  # a view into the frame, not a copy


def test_answers_that_do_not_line_up_go_in_frames_of_their_own() -> None:
    one = Result(1, {"y": np.ones((1, 4), np.float32)}, 0.0)
    wider = Result(2, {"y": np.ones((1, 5), np.float32)}, 0.0)
    other_dtype = Result(3, {"y": np.ones((1, 4), np.float64)}, 0.0)
    other_name = Result(4, {"z": np.ones((1, 4), np.float32)}, 0.0)
    for pair in ([one, wider], [one, other_dtype], [one, other_name]):
        assert batched(pair, 0) == pair
    assert batched([one], 0) == [one]
    assert batched([one, one], 2) == [one, one]  # no dimension 2 to join them on
    (joined,) = batched([one, Result(5, {"y": np.ones((2, 4), np.float32)}, 0.0)], 0)
    assert isinstance(joined, Results) and joined.lengths == ((1, 2),)
    columns = [Result(6, {"y": np.ones((3, 1))}, 0.0), Result(7, {"y": np.zeros((3, 2))}, 0.0)]
    (along_1,) = batched(columns, 1)
    back = round_trip(along_1).answers()  # type: ignore[attr-defined]
    assert [a.tensors["y"].shape for a in back] == [(3, 1), (3, 2)]
    assert back[1].tensors["y"].sum() == 0


def test_results_whose_lengths_do_not_add_up_are_refused() -> None:
    frame = Results((1, 2), (0.0, 0.0), ((1, 2),), 0, {"y": np.ones((4, 2), np.float32)})
    with pytest.raises(WireError, match=r"does not hold answers of lengths \[1, 2\]"):
        round_trip(frame)


def test_non_contiguous_arrays_are_sent_in_row_major_order() -> None:
    array = np.arange(12, dtype=np.int32).reshape(3, 4).T
    result = round_trip(Result(2, {"t": array}, 0.0))
    assert isinstance(result, Result)
    np.testing.assert_array_equal(result.tensors["t"], array)


def test_failures_and_pings_round_trip() -> None:
    failure = Failure(9, FailureCode.REFUSED, "too late: ünïcode", 0.5)
    assert round_trip(failure) == failure
    judged = Failure(9, FailureCode.REFUSED, "too late", 0.5, 0.142, 0.1, 180)
    assert round_trip(judged) == judged
    assert round_trip(Ping(3)) == Ping(3)
    assert round_trip(Pong(4)) == Pong(4)
    word = Backlog(0.15, 7, 0.2, 0.03, 1.5, next_rows=3, id=5)
    assert round_trip(word) == word


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


def test_a_reader_says_when_a_frame_has_begun_and_not_ended() -> None:
    small, big = Ping(1), Call(2, 1.0, STAGE_BYTES, {"x": np.zeros(STAGE_BYTES, np.float32)})
    stream = frame_bytes(small) + frame_bytes(big)
    reader = FrameReader()
    assert not reader.partial
    assert len(reader.feed(stream[:2])) == 0 and reader.partial  # half a length
    assert len(reader.feed(stream[2 : len(frame_bytes(small))])) == 1 and not reader.partial
    assert reader.feed(stream[len(frame_bytes(small)) : -1]) == [] and reader.partial
    assert len(reader.feed(stream[-1:])) == 1 and not reader.partial


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


def test_bytes_are_laid_out_as_lengths_and_data_and_keep_later_tensors_aligned() -> None:
    words = np.array([b"ab", b"", b"cde"], dtype=object)
    frame = frame_bytes(Result(3, {"w": words, "f": np.ones(2, np.float64)}, 0.0))
    assert struct.pack("<Q", 17) + struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0) + (
        struct.pack("<I", 3) + b"cde") in frame
    result = round_trip(Result(3, {"w": words, "f": np.ones(2, np.float64)}, 0.0))
    assert isinstance(result, Result)
    assert result.tensors["w"].tolist() == [b"ab", b"", b"cde"]
    assert result.tensors["f"].ctypes.data % 8 == 0


def bytes_call(data: bytes, count: int = 2) -> bytearray:
    """A Call frame body with one BYTES tensor of `count` elements whose data are `data`."""
    code = list(DATATYPES).index("BYTES")
    head = struct.pack("<BQddddIHB", 1, 1, 1.0, 0.0, 0.0, 0.0, count, 1, 0)
    head += b"\x01w" + bytes([code, 1])
    head += struct.pack("<q", count)
    head += b"\0" * (-len(head) % 8)
    return bytearray(head + struct.pack("<Q", len(data)) + data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (struct.pack("<I", 2) + b"ab" + struct.pack("<I", 9) + b"cd",
         "tensor 'w' has element 1 overrunning its data"),
        (struct.pack("<I", 2) + b"ab" + b"\0\0", "tensor 'w' has element 1 overrunning its data"),
        (struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"bXY",
         "tensor 'w' has 2 bytes after its elements"),
    ],
)
def test_malformed_bytes_tensors_raise_wire_errors(data: bytes, message: str) -> None:
    assert isinstance(decode(bytes_call(struct.pack("<I", 1) + b"a" + struct.pack("<I", 0))),
                      Call)  # the well-formed frame reads
    with pytest.raises(WireError, match=message):
        decode(bytes_call(data))


def test_a_bytes_tensor_announcing_more_than_its_frame_is_refused() -> None:
    body = bytes_call(b"")
    body[-8:] = struct.pack("<Q", 100)
    with pytest.raises(WireError, match="tensor 'w' of 100 bytes overruns its frame"):
        decode(body)


def test_bytes_tensors_hold_only_bytes() -> None:
    with pytest.raises(WireError, match="tensor 'w' is BYTES but holds a str"):
        encode(Result(1, {"w": np.array(["text"], dtype=object)}, 0.0))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (struct.pack("<BQ", 99, 1), "unknown frame kind 99"),
        (b"\x01", "malformed frame"),
        (struct.pack("<BQddddIHB", 1, 1, 1.0, 0.0, 0.0, 0.0, 1, 1, 0) + b"\x01x\x63\x01"
             + b"\0" * 16,
         "unknown dtype"),
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


def test_a_call_carries_its_group_and_tensors_stay_aligned_after_it() -> None:
    x = np.arange(6, dtype=np.float64).reshape(3, 2)
    call = round_trip(Call(3, 1.0, 3, {"x": x}, ('"en"', '"fr"', "7", '"ünï"'), 0.125, 3e-4))
    assert call.spent_s == 0.125
    assert call.front_s == 3e-4
    assert isinstance(call, Call) and call.group == ('"en"', '"fr"', "7", '"ünï"')
    np.testing.assert_array_equal(call.tensors["x"], x)
    assert call.tensors["x"].ctypes.data % 8 == 0


def test_a_group_value_overrunning_its_frame_is_refused() -> None:
    body = struct.pack("<BQddddIHB", 1, 1, 1.0, 0.0, 0.0, 0.0, 1, 0, 1) + struct.pack("<H", 50)
    body += b"en"
    with pytest.raises(WireError, match="group value overruns its frame"):
        decode(bytearray(body))
