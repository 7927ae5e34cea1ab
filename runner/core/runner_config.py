"""A runner's configuration as typed values: its tensors, its batching, its processes.

These are the values `batchserve.runner.core.config` reads `configuration.yml` into, apart
from the reading, so that what builds on a runner's configuration (the pipelines of
`batchserve.runner.core.pipeline`) imports them without the reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from .types import DATATYPES
from .wire import Address

Choice = Literal["random", "least_loaded_of_two"]
"""How an API worker picks one of a runner's connected processes for a request (the
implementations are in `batchserve.api.choice`)."""
CHOICES: tuple[Choice, ...] = get_args(Choice)

Refuse = Literal["at_arrival", "oldest"]
"""When a runner that cannot serve every request on time says so: each request as it arrives
(`at_arrival`: its 503 comes at once), or, admitting all, the oldest requests when the model
frees and their batch would end past their deadline (`oldest`: more answers on time on a tight
limit, refusals that have waited about a batch). See docs/dispatcher.md, "Refusal modes"."""
REFUSE_MODES: tuple[Refuse, ...] = get_args(Refuse)


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named tensor of a model's v2 signature; -1 marks a variable dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    finite: bool = False  # the model cannot take NaN or infinity: refuse them with a 400
    layout: Layout = "rows"  # how requests of different lengths join (see `Layout`)
    pad_value: float = 0.0  # what fills a padded input past a request's own length
    # False: requests are not joined on this input; the model gets one item per request.
    batchable: bool = True

    @property
    def dtype(self) -> np.dtype[Any]:
        return DATATYPES[self.datatype]


Layout = Literal["rows", "ragged", "pad"]
"""How an input's requests join into a batch: stacked as rows along the batch dimension
(`rows`), or, for a flat input of one sequence a request, concatenated into one flat tensor
(`ragged`) or padded to the longest in the batch as rows (`pad`); see
`batchserve.runner.core.ragged`."""

BatchInputKind = Literal[
    "element_count", "accumulated_element_count", "accumulated_element_count_with_zero"
]
BATCH_INPUT_KINDS: tuple[BatchInputKind, ...] = (
    "element_count", "accumulated_element_count", "accumulated_element_count_with_zero"
)


@dataclass(frozen=True, slots=True)
class BatchInput:
    """A tensor the runner generates for each batch and passes to the model as an input named
    `name`: per request, the element count of input `source` (or their running sum)."""

    kind: BatchInputKind
    name: str
    source: str
    datatype: str = "INT64"

    @property
    def dtype(self) -> np.dtype[Any]:
        return DATATYPES[self.datatype]


@dataclass(frozen=True, slots=True)
class Batching:
    enabled: bool = True
    max_batch_size: int = 64
    max_latency_ms: float = 100.0
    max_batch_elements: int | None = None  # the cap in elements, for ragged or pad inputs
    refuse: Refuse = "at_arrival"


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    name: str
    model: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    workers: int = 1
    batching: Batching = field(default_factory=Batching)
    batch_dim: tuple[int, int] = (0, 0)
    threads: int = 1
    batch_timeout_ms: float | None = None
    batch_inputs: tuple[BatchInput, ...] = ()
    group_by: tuple[str, ...] = ()
    """Request parameters that must be equal within a batch (a translation model takes one
    source and target language a call); the model gets their values as keyword arguments."""
    group_timing: tuple[tuple[str, Any], ...] = ()
    """The `group_by` values the model is timed with at start-up, where the configuration
    gives them (`group_by` as a mapping); the model's own defaults otherwise."""
    addresses: tuple[Address, ...] = ()
    """Where this runner's processes listen when they run apart (`batchserve runner`); empty
    when `batchserve serve` starts them itself."""
    choice: Choice = "random"

    @property
    def layout(self) -> Layout:
        """`ragged` or `pad` when the runner's inputs are of variable length, else `rows`."""
        return self.inputs[0].layout

    @property
    def max_cost(self) -> int:
        """The batch cap in the units a batch's cost is counted in: elements for ragged or
        pad inputs (`max_batch_elements`), rows otherwise (`max_batch_size`)."""
        elements = self.batching.max_batch_elements
        return self.batching.max_batch_size if elements is None else elements

    @property
    def unbatched(self) -> frozenset[str]:
        """The inputs declared `batchable: false`, which the model gets as per-request lists."""
        return frozenset(spec.name for spec in self.inputs if not spec.batchable)

    @property
    def batch_timeout_s(self) -> float:
        """How long one model call may run before its requests fail (504): by default ten
        times the latency limit, and at least a second, well above any batch that could
        still have answered in time."""
        if self.batch_timeout_ms is not None:
            return self.batch_timeout_ms / 1000.0
        return max(10.0 * self.batching.max_latency_ms, 1000.0) / 1000.0
