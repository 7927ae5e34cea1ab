"""A runner's input signature and the one check of tensors against it.

Tensors are checked in two places: the API checks each input of a request as it decodes it
(a declared datatype and shape come before the data they describe, which is read by them),
and a runner checks the tensors of every call it receives (it may be reached by clients other
than the API). Both ask a `Signature`, so an input is judged by the same rules, in the same
words, wherever it is checked. A disagreement raises `SignatureError`, whose message names the
input and what was expected; the API answers it with a 400, a runner with an INVALID failure.

The row count of a call (its length along the input batch dimension) is counted here once,
by `Signature.rows`, and travels with the call from then on. Inputs declared `batchable: false`
have no batch dimension: they are checked like any other input but do not count rows. A BYTES
input is a numpy object array whose every element is `bytes`.

A runner whose inputs are `ragged` or `pad` takes one sequence a request: such a request is
one row, whatever its length, and is never cut, so each input must hold 1 to
`max_batch_elements` elements. What it costs the batching policy is counted here too, by
`Signature.cost`: its rows, or for those runners its elements (`batchserve.runner.core.ragged`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, NoReturn

import numpy as np

from . import ragged
from .config import Layout, RunnerConfig, TensorSpec
from .types import BYTES, DATATYPES

__all__ = ["Signature", "SignatureError", "batch_rows", "fits", "shape_text", "show"]

_DATATYPE_NAMES = {dtype: name for name, dtype in DATATYPES.items()}


class SignatureError(ValueError):
    """Tensors that disagree with a runner's signature; the message says what was expected."""


# --- words for error messages -------------------------------------------------------------------


def show(value: Any) -> str:
    """A value quoted for an error message, cut short: it may be a whole tensor."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shape_text(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def fits(shape: tuple[int, ...] | list[int], pattern: tuple[int, ...]) -> bool:
    """Whether `shape` matches a signature shape, where -1 matches any size."""
    # Plain loops here: the all()/any() generator form costs a microsecond per request.
    if len(shape) != len(pattern):
        return False
    for got, want in zip(shape, pattern, strict=True):
        if want != got and want != -1:
            return False
    return True


def batch_rows(
    arrays: Mapping[str, np.ndarray], dim: int = 0, skip: Collection[str] = ()
) -> int:
    """The batch size the arrays (but those named in `skip`) share along `dim`: at least 1.

    The server's check and the Python client's both count rows here, so they agree.
    """
    first, rows = "", -1
    for name, array in arrays.items():
        if name in skip:
            continue
        if array.ndim <= dim:
            raise SignatureError(
                f"input {name!r} has {array.ndim} dimensions; expected a batch dimension {dim}"
            )
        count = array.shape[dim]
        if count == 0:
            raise SignatureError(
                f"input {name!r} has 0 rows (dimension {dim}); expected at least 1"
            )
        if rows == -1:
            first, rows = name, count
        elif count != rows:
            raise SignatureError(
                f"input {name!r} has {count} rows (dimension {dim}) but input {first!r} "
                f"has {rows}; expected the same batch size for all inputs"
            )
    return rows


# --- the signature ------------------------------------------------------------------------------


class Signature:
    """The inputs a runner's model takes, by name, the dimension they are batched on, those
    that are not batched (`batchable: false`), and how requests join (`layout`): as rows, or
    as sequences of at most `max_elements` elements."""

    __slots__ = ("model", "specs", "batch_dim", "unbatched", "layout", "max_elements")

    def __init__(self, runner: RunnerConfig) -> None:
        self.model = runner.name
        self.specs = {spec.name: spec for spec in runner.inputs}
        self.batch_dim = runner.batch_dim[0]
        self.unbatched = runner.unbatched
        self.layout: Layout = runner.layout
        self.max_elements = runner.max_cost

    def spec(self, name: str) -> TensorSpec:
        """The input called `name`, or the error that names the inputs there are."""
        spec = self.specs.get(name)
        if spec is None:
            raise SignatureError(
                f"input {name!r} is not an input of model {self.model!r}; expected one of: "
                + ", ".join(self.specs)
            )
        return spec

    @staticmethod
    def check_datatype(spec: TensorSpec, datatype: Any) -> None:
        """`datatype` is a v2 datatype name as declared, or any value a client sent."""
        if datatype == spec.datatype:
            return
        shown = datatype if isinstance(datatype, str) else show(datatype)
        raise SignatureError(f"input {spec.name!r} has datatype {shown}; expected {spec.datatype}")

    @staticmethod
    def check_shape(spec: TensorSpec, shape: Any) -> tuple[int, ...]:
        """`shape` as a tuple, if it is a list or tuple of sizes that fits the input's."""
        kind = type(shape)
        if kind is not list and kind is not tuple:
            _bad_shape(spec, shape)
        for size in shape:
            if type(size) is not int or size < 0:
                _bad_shape(spec, shape)
        if not fits(shape, spec.shape):
            _bad_shape(spec, shape)
        return tuple(shape)

    @staticmethod
    def check_bytes(spec: TensorSpec, array: np.ndarray) -> None:
        """A BYTES array holds `bytes` and nothing else (an object array could hold anything)."""
        if spec.dtype != BYTES:
            return
        for item in array.flat:
            if type(item) is not bytes:
                raise SignatureError(
                    f"input {spec.name!r} holds a {type(item).__name__} element; expected "
                    "bytes in every element of a BYTES tensor"
                )

    def check_finite(self, spec: TensorSpec, array: np.ndarray) -> None:
        if spec.finite and not np.isfinite(array).all():
            raise SignatureError(
                f"input {spec.name!r} holds NaN or infinity; model {self.model!r} takes "
                "finite values only"
            )

    def check_complete(self, names: Collection[str]) -> None:
        """Every input is there (`names` holds only inputs of the signature, each once)."""
        if len(names) == len(self.specs):
            return
        missing = next(spec for spec in self.specs.values() if spec.name not in names)
        raise SignatureError(
            f"input {missing.name!r} is missing; model {self.model!r} needs it as "
            f"{missing.datatype} with shape {shape_text(missing.shape)}"
        )

    def rows(self, tensors: Mapping[str, np.ndarray]) -> int:
        """The batch size all batchable inputs share along the batch dimension: at least 1;
        exactly 1 for ragged or pad inputs, once each is a sequence that one batch can hold."""
        if self.layout == "rows":
            return batch_rows(tensors, self.batch_dim, self.unbatched)
        for name, array in tensors.items():
            self._check_sequence(name, array.shape[0])
        return 1

    def _check_sequence(self, name: str, length: int) -> None:
        if length == 0:
            raise SignatureError(
                f"input {name!r} has 0 elements; a {self.layout} input expects a sequence "
                "of at least 1"
            )
        if length > self.max_elements:
            raise SignatureError(
                f"input {name!r} has {length} elements; model {self.model!r} takes at most "
                f"{self.max_elements} in a batch (its max_batch_elements), and a request is "
                "never split"
            )

    def cost(self, tensors: Mapping[str, np.ndarray], rows: int) -> int:
        """What a checked request of `rows` rows weighs against the runner's cap: its rows,
        or for ragged or pad inputs its elements (its longest sequence)."""
        return rows if self.layout == "rows" else ragged.elements(tensors)

    def check(self, tensors: Mapping[str, np.ndarray], rows: int) -> None:
        """Every check at once, on arrays, as a runner receives them with their row count."""
        for name, array in tensors.items():
            spec = self.spec(name)
            # The name is looked up first: formatting a dtype costs more than the whole lookup.
            self.check_datatype(spec, _DATATYPE_NAMES.get(array.dtype) or str(array.dtype))
            self.check_shape(spec, array.shape)
            self.check_bytes(spec, array)
            self.check_finite(spec, array)
        self.check_complete(tensors.keys())
        counted = self.rows(tensors)
        if counted != rows:
            raise SignatureError(
                f"the call says it has {rows} rows, but its inputs have {counted} "
                f"(dimension {self.batch_dim})"
            )


def _bad_shape(spec: TensorSpec, shape: Any) -> NoReturn:
    plain = isinstance(shape, list | tuple) and all(type(size) is int for size in shape)
    text = shape_text(shape) if plain else show(shape)
    raise SignatureError(
        f"input {spec.name!r} has shape {text}; expected {shape_text(spec.shape)}"
    )
