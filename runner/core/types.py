"""The tensor vocabulary every layer shares: v2 datatypes and named batches of arrays.

Apart from the configuration so that the wire, the models and the API's codec can use them
without importing the YAML loader. A BYTES tensor is a numpy object array whose elements
are `bytes`: each element is one string of any length, as the v2 protocol defines it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Tensors = dict[str, np.ndarray]
"""Named arrays: a request's inputs or a batch's outputs."""

DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}

BYTES = DATATYPES["BYTES"]


class PerRequest(list[Any]):
    """A non-batchable input of a batch: one item (that request's array) per request.

    Requests are not joined on such an input, since its values cannot be stacked or mean
    something only for the whole request (a mode, a language). `rows` holds each request's
    number of rows, in order, so that a model can find which rows of its batchable inputs
    go with which item; `per_row` does that for it.
    """

    def __init__(self, items: list[Any], rows: tuple[int, ...]) -> None:
        super().__init__(items)
        self.rows = rows

    def per_row(self) -> list[Any]:
        """Each item repeated once for every row of its request, in the batch's row order."""
        return [item for item, count in zip(self, self.rows, strict=True) for _ in range(count)]


ModelInputs = dict[str, np.ndarray | PerRequest]
"""What a model gets: batchable inputs joined into one array, the others as `PerRequest`."""
