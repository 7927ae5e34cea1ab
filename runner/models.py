"""Turning whatever a runner's `model` names into one calling convention.

`model` may name a factory (a class or a function without required parameters), a torch
`nn.Module`, or any callable. Every one ends up as a `Model`: a function from named numpy
batches to named numpy outputs. One input is passed positionally; several are passed as
keyword arguments, batched key by key. An input declared `batchable: false` comes as a
`PerRequest` list, one item per request of the batch. An output may be one array, a tuple
in the declared order, or a dict by name. BYTES tensors are numpy object arrays of `bytes`,
for torch models too (torch has no string tensors); a BYTES output may also hold `str`
elements, which are sent as UTF-8.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .core.config import Config, ConfigError, RunnerConfig, resolve
from .core.types import BYTES, ModelInputs, PerRequest, Tensors


class ModelError(RuntimeError):
    """The model raised or returned something that does not match its signature."""


def _is_factory(target: Any) -> bool:
    if inspect.isclass(target):
        return True
    if not inspect.isfunction(target):
        return False
    parameters = inspect.signature(target).parameters.values()
    required = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return all(p.default is not p.empty or p.kind not in required for p in parameters)


def _torch_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


class Model:
    """A runner's model behind the one calling convention of named numpy tensors."""

    def __init__(self, runner: RunnerConfig, function: Callable[..., Any], torch: bool) -> None:
        self.runner = runner
        self._function = function
        self._torch = torch
        # Batch inputs (offsets, lengths) come after the inputs; together they are keywords.
        self._names = [spec.name for spec in runner.inputs]
        self._names += [made.name for made in runner.batch_inputs]
        self._outputs = [spec for spec in runner.outputs]

    def __call__(self, inputs: ModelInputs, options: Mapping[str, Any] | None = None) -> Tensors:
        """Run the model on one batch; `options` (the batch's `group_by` values) go to it as
        keyword arguments."""
        options = options or {}
        if self._torch:
            return self._call_torch(inputs, options)
        return self._collect(self._invoke(inputs, options))

    def _invoke(self, inputs: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        if len(self._names) == 1:
            return self._function(inputs[self._names[0]], **options)
        return self._function(**inputs, **options)

    def _call_torch(self, inputs: ModelInputs, options: Mapping[str, Any]) -> Tensors:
        import torch

        def tensor(array: np.ndarray) -> Any:
            return array if array.dtype == BYTES else torch.from_numpy(array)

        def convert(value: np.ndarray | PerRequest) -> Any:
            if isinstance(value, PerRequest):
                return PerRequest([tensor(item) for item in value], value.rows)
            return tensor(value)

        with torch.inference_mode():
            result = self._invoke(
                {name: convert(value) for name, value in inputs.items()}, options
            )
            return self._collect(result)

    def _collect(self, result: Any) -> Tensors:
        if isinstance(result, Mapping):
            values = [result.get(spec.name) for spec in self._outputs]
        elif isinstance(result, Sequence) and not isinstance(result, str | bytes):
            values = list(result)
        else:
            values = [result]
        if len(values) != len(self._outputs) or any(v is None for v in values):
            names = [spec.name for spec in self._outputs]
            raise ModelError(f"model returned {type(result).__name__}; expected outputs {names}")
        return {spec.name: (_as_sequences(spec.name, value, spec.dtype)
                            if spec.layout == "ragged" else
                            self._as_array(spec.name, value, spec.dtype))
                for spec, value in zip(self._outputs, values, strict=True)}

    @staticmethod
    def _as_array(name: str, value: Any, dtype: np.dtype[Any]) -> np.ndarray:
        if dtype == BYTES:
            return _as_bytes(name, value)
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        array = np.asarray(value)
        if array.dtype != dtype:
            array = array.astype(dtype)
        return array


def _as_sequences(name: str, value: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """A ragged output, one sequence a row of the batch (a list of 1-D arrays), as an object
    array of those arrays: it splits by rows as any output does, and each request's are then
    joined into one flat sequence (`batchserve.runner.batching.split`)."""
    if isinstance(value, np.ndarray) or not isinstance(value, Sequence):
        raise ModelError(f"model returned output {name!r} as {type(value).__name__}; a ragged "
                         "output is a list with one 1-D sequence a row")
    sequences = np.empty(len(value), dtype=object)
    for i, item in enumerate(value):
        if hasattr(item, "detach"):
            item = item.detach().cpu().numpy()
        array = np.asarray(item, dtype=dtype)
        if array.ndim != 1:
            raise ModelError(f"model returned output {name!r} with a sequence of shape "
                             f"{list(array.shape)}; a ragged output holds 1-D sequences")
        sequences[i] = array
    return sequences


def _as_bytes(name: str, value: Any) -> np.ndarray:
    """A BYTES output as an object array of `bytes`; `str` elements become UTF-8."""
    array = np.array(value, dtype=object)  # a copy: the elements are replaced below
    for index, item in np.ndenumerate(array):
        if isinstance(item, str):
            array[index] = item.encode()
        elif type(item) is not bytes:
            if not isinstance(item, bytes | bytearray | memoryview):
                raise ModelError(
                    f"model returned output {name!r} holding a {type(item).__name__}; "
                    "BYTES outputs hold bytes or str"
                )
            array[index] = bytes(item)
    return array


def load(config: Config, runner: RunnerConfig) -> Model:
    """Import, build and wrap a runner's model."""
    target = resolve(config, runner)
    try:
        model = target() if _is_factory(target) else target
    except Exception as exc:
        raise ConfigError(
            f"runners.{runner.name}.model has value {runner.model!r}; building it raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not callable(model):
        raise ConfigError(
            f"runners.{runner.name}.model has value {runner.model!r}; it names a "
            f"{type(model).__name__}, which is neither a model nor a factory of one"
        )
    is_torch = _torch_module(model)
    if is_torch:
        model.eval()  # type: ignore[union-attr]
    return Model(runner, model, is_torch)
