"""The tensor vocabulary every layer shares: v2 datatypes and named batches of arrays.

Apart from the configuration so that the wire, the models and the API's codec can use them
without importing the YAML loader.
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
}
