"""Concatenating requests into one batch and splitting the outputs back.

Requests are joined along the input batch dimension and each gets back the slice of every
output, along the output batch dimension, that matches its own number of rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from batchserve.runner.types import Tensors


def concatenate(parts: Sequence[Tensors], dim: int) -> Tensors:
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([part[name] for part in parts], axis=dim) for name in parts[0]}


def split(outputs: Tensors, sizes: Sequence[int], dim: int) -> list[Tensors]:
    """Cut each output at the request boundaries; the slices are views, not copies."""
    total = sum(sizes)
    for name, array in outputs.items():
        if array.ndim <= dim or array.shape[dim] != total:
            raise ValueError(
                f"output {name!r} has shape {list(array.shape)}; its dimension {dim} must be "
                f"the batch of {total} rows"
            )
    if len(sizes) == 1:
        return [outputs]
    cuts = list(accumulate(sizes))[:-1]
    pieces = {name: np.split(array, cuts, axis=dim) for name, array in outputs.items()}
    return [{name: pieces[name][i] for name in outputs} for i in range(len(sizes))]


def chunk(tensors: Tensors, rows: int, dim: int, size: int) -> list[tuple[Tensors, int]]:
    """Cut a request of `rows` rows into pieces of at most `size` rows (views), each with
    its own row count."""
    lead = (slice(None),) * dim
    return [
        ({name: array[(*lead, slice(start, start + size))] for name, array in tensors.items()},
         min(size, rows - start))
        for start in range(0, rows, size)
    ]
