"""Variable-length inputs: joining requests of different lengths into one batch.

An input declared `ragged` holds one flat sequence a request; a batch concatenates them into
one flat tensor, so no element is computed that a request did not send. An input declared
`pad` is stacked instead as rows padded to the longest request with the input's pad value.
Either way the model also gets the runner's batch inputs, generated once the batch is formed
(the lengths are only known then). For requests of 3, 4 and 5 elements:

    element_count                         [3, 4, 5]      each request's length
    accumulated_element_count             [3, 7, 12]     where each request ends
    accumulated_element_count_with_zero   [0, 3, 7, 12]  where each starts, and the total

Each request is one row of every output. What it costs, the unit the batching policy and the
latency model count in and `max_batch_elements` caps, is its elements (the longest of its
inputs): the model's work follows tokens, not requests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .types import Tensors

if TYPE_CHECKING:
    from .config import BatchInputKind, RunnerConfig, TensorSpec

BATCH_INPUTS: dict[BatchInputKind, Callable[[np.ndarray], np.ndarray]] = {
    "element_count": lambda counts: counts,
    "accumulated_element_count": np.cumsum,
    "accumulated_element_count_with_zero": lambda counts: np.concatenate(
        (np.zeros(1, counts.dtype), np.cumsum(counts))
    ),
}
"""Each batch input kind, from the requests' element counts of its source input."""


def elements(tensors: Mapping[str, np.ndarray]) -> int:
    """A request's cost in elements: the length of its longest input."""
    return max(int(array.shape[0]) for array in tensors.values())


def join(runner: RunnerConfig, parts: Sequence[Tensors]) -> Tensors:
    """The model's inputs for a batch of requests: each input joined by its layout, then the
    batch inputs, each cast to its datatype."""
    joined = {
        spec.name: _JOINS[spec.layout](spec, [part[spec.name] for part in parts])
        for spec in runner.inputs
    }
    for made in runner.batch_inputs:
        counts = np.array([part[made.source].shape[0] for part in parts], dtype=np.int64)
        joined[made.name] = BATCH_INPUTS[made.kind](counts).astype(made.dtype)
    return joined


def _concatenate(spec: TensorSpec, arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _pad(spec: TensorSpec, arrays: list[np.ndarray]) -> np.ndarray:
    longest = max(array.shape[0] for array in arrays)
    padded = np.full((len(arrays), longest), spec.pad_value, dtype=spec.dtype)
    for row, array in zip(padded, arrays, strict=True):
        row[: array.shape[0]] = array
    return padded


_JOINS: dict[str, Callable[[TensorSpec, list[np.ndarray]], np.ndarray]] = {
    "ragged": _concatenate,
    "pad": _pad,
}


def synthetic(runner: RunnerConfig, elements: int, seed: int = 0) -> list[Tensors]:
    """Requests of `elements` in all, for timing the model before it serves: as many as
    `max_batch_size` allows, of lengths as even as can be. Integer inputs are zeros (a valid
    token id), floating ones drawn from a normal law."""
    count = min(runner.batching.max_batch_size, elements)
    base, extra = divmod(elements, count)
    generator = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        length = base + (1 if i < extra else 0)
        requests.append({spec.name: _values(spec, length, generator) for spec in runner.inputs})
    return requests


def _values(spec: TensorSpec, length: int, generator: np.random.Generator) -> np.ndarray:
    if spec.dtype.kind == "f":
        return generator.standard_normal(length).astype(spec.dtype)
    return np.zeros(length, dtype=spec.dtype)
