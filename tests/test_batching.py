"""Joining requests into a batch and cutting them up: non-batchable inputs stay per request."""

from __future__ import annotations

import numpy as np

from batchserve.runner import batching
from batchserve.runner.core.types import PerRequest


def request(rows: int, mode: bytes) -> dict[str, np.ndarray]:
    return {"x": np.arange(rows * 2, dtype=np.float32).reshape(rows, 2),
            "mode": np.array([mode], dtype=object)}


def test_a_non_batchable_input_is_a_list_with_one_item_per_request() -> None:
    parts = [request(2, b"a"), request(1, b"b"), request(3, b"a")]
    joined = batching.join(parts, 0, {"mode"})
    assert joined["x"].shape == (6, 2)
    mode = joined["mode"]
    assert isinstance(mode, PerRequest)
    assert [item.tolist() for item in mode] == [[b"a"], [b"b"], [b"a"]]
    assert mode.rows == (2, 1, 3)
    assert [item[0] for item in mode.per_row()] == [b"a", b"a", b"b", b"a", b"a", b"a"]


def test_a_lone_request_still_gets_a_list() -> None:
    joined = batching.join([request(2, b"a")], 0, {"mode"})
    assert isinstance(joined["mode"], PerRequest) and joined["mode"].rows == (2,)


def test_without_non_batchable_inputs_every_input_is_joined() -> None:
    parts = [{"x": np.ones((2, 2))}, {"x": np.zeros((1, 2))}]
    assert batching.join(parts, 0)["x"].shape == (3, 2)


def test_rows_are_counted_on_batchable_inputs() -> None:
    parts = {"mode": np.array([b"m"], dtype=object), "x": np.ones((5, 2))}
    assert batching.rows(parts, 0, {"mode"}) == 5


def test_every_piece_of_a_cut_request_keeps_its_non_batchable_inputs_whole() -> None:
    pieces = batching.chunk(request(5, b"m"), 5, 0, 2, {"mode"})
    assert [piece["x"].shape[0] for piece, _ in pieces] == [2, 2, 1]
    assert [size for _, size in pieces] == [2, 2, 1]
    assert all(piece["mode"].tolist() == [b"m"] for piece, _ in pieces)


def test_bytes_outputs_split_by_rows() -> None:
    words = np.array([b"a", b"bb", b"", b"ccc"], dtype=object)
    first, second = batching.split({"w": words}, [3, 1], 0)
    assert first["w"].tolist() == [b"a", b"bb", b""]
    assert second["w"].tolist() == [b"ccc"]
