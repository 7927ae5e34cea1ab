"""Concatenating requests into one batch and splitting the outputs back.

Requests are joined along the input batch dimension and each gets back the slice of every
output, along the output batch dimension, that matches its own number of rows.

Inputs declared `batchable: false` (named in `unbatched`) are never joined: the model gets a
`PerRequest` list with each request's array as it came, one item per request whatever its
number of rows, and a request cut into pieces gives every piece the whole array. Outputs are
split by rows as usual, so the model answers row by row even for such inputs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import accumulate

import numpy as np

from .core.types import ModelInputs, PerRequest, Tensors


def rows(tensors: Tensors, dim: int, unbatched: Collection[str] = ()) -> int:
    """The batch size of a request: its length along the batch dimension."""
    first = next(a for name, a in tensors.items() if name not in unbatched)
    return int(first.shape[dim])


def concatenate(parts: Sequence[Tensors], dim: int) -> Tensors:
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([part[name] for part in parts], axis=dim) for name in parts[0]}


def join(parts: Sequence[Tensors], dim: int, unbatched: Collection[str] = ()) -> ModelInputs:
    """A batch's model inputs: batchable ones concatenated, the others one item a request."""
    if not unbatched:
        return dict(concatenate(parts, dim))
    sizes = tuple(rows(part, dim, unbatched) for part in parts)
    batchable = [{k: a for k, a in part.items() if k not in unbatched} for part in parts]
    joined = concatenate(batchable, dim)
    return {name: PerRequest([part[name] for part in parts], sizes) if name in unbatched
            else joined[name] for name in parts[0]}


def split(outputs: Tensors, sizes: Sequence[int], dim: int,
          ragged: Collection[str] = ()) -> list[Tensors]:
    """Cut each output at the request boundaries; the slices are views, not copies. A
    `ragged` output comes as one sequence a row (an object array of 1-D arrays): each
    request gets its rows' sequences joined into one flat array."""
    if ragged:
        return [{name: _flat(piece[name]) if name in ragged else piece[name] for name in piece}
                for piece in split(outputs, sizes, dim)]
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


def _flat(sequences: np.ndarray) -> np.ndarray:
    """A request's sequences of a ragged output, one after another."""
    return sequences[0] if len(sequences) == 1 else np.concatenate(list(sequences))


def chunk(
    tensors: Tensors, rows: int, dim: int, size: int, unbatched: Collection[str] = ()
) -> list[tuple[Tensors, int]]:
    """Cut a request of `rows` rows into pieces of at most `size` rows (views), each with
    its own row count; every piece keeps the whole of each unbatched input."""
    lead = (slice(None),) * dim
    return [
        ({name: array if name in unbatched else array[(*lead, slice(start, start + size))]
          for name, array in tensors.items()},
         min(size, rows - start))
        for start in range(0, rows, size)
    ]
