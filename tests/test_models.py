"""Every way a runner's `model` can be written, behind the one calling convention of `Model`.

The models under test live in this module: a runner names them as `tests.test_models:NAME`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from batchserve.runner import models
from batchserve.runner.core.config import Config, ConfigError, RunnerConfig, parse
from batchserve.runner.models import Model, ModelError

ROOT = Path(__file__).parents[1]

# --- models, one per calling convention -------------------------------------------------------


class Doubler:
    """A factory class: the runner builds one instance and calls it."""

    def __init__(self) -> None:
        self.factor = 2.0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x * self.factor


def make_tripler(factor: float = 3.0) -> Any:
    """A factory function: no required parameters, so it is called to build the model."""
    return lambda x: x * factor


def negate(rows: np.ndarray) -> np.ndarray:
    """A plain function: its one input comes positionally, whatever its parameter's name."""
    return -rows


class Scaler:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x * self.factor


halver = Scaler(0.5)  # a callable object, used as it is


def weighted_sum(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Several inputs come as keyword arguments named as the inputs."""
    return (x * w).sum(axis=1, keepdims=True)


def sum_and_count(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Several outputs as a tuple, in the declared order."""
    return x.sum(axis=1, keepdims=True), np.full((len(x), 1), x.shape[1])


def sum_and_count_by_name(x: np.ndarray) -> dict[str, np.ndarray]:
    """Several outputs as a dict by name, in any order."""
    total, count = sum_and_count(x)
    return {"count": count, "total": total}


def as_float64(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) + 0.25


class TorchAffine(torch.nn.Module):
    """A torch module: tensors in, tensors out, in inference mode and eval()."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[1.0, 10.0]]))
            self.linear.bias.fill_(0.5)
        self.seen: list[tuple[type, bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((type(x), torch.is_inference_mode_enabled(), self.training))
        return self.linear(x)


class TorchWeightedSum(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": (x * w).sum(dim=1, keepdim=True)}


torch_affine = TorchAffine()  # an instance: used as it is, and put in eval mode


def broken_factory() -> Any:
    raise ValueError("no weights")


not_a_model = {"weights": [1, 2]}


def make_a_dict() -> dict[str, int]:
    return {"weights": 1}


# --- helpers ----------------------------------------------------------------------------------

X = "{name: x, datatype: FP32, shape: [-1, 2]}"
W = "{name: w, datatype: FP32, shape: [-1, 2]}"
Y = "{name: y, datatype: FP32, shape: [-1, 1]}"
Y2 = "{name: y, datatype: FP32, shape: [-1, 2]}"
TOTAL_COUNT = ("{name: total, datatype: FP32, shape: [-1, 1]}, "
               "{name: count, datatype: INT64, shape: [-1, 1]}")


def config(model: str, inputs: str = X, outputs: str = Y2) -> tuple[Config, RunnerConfig]:
    document = {"runners": {"m": {"model": model, "inputs": _yaml(inputs),
                                  "outputs": _yaml(outputs)}}}
    parsed = parse(document, root=ROOT)
    return parsed, parsed.runners["m"]


def _yaml(specs: str) -> list[dict[str, Any]]:
    loaded: list[dict[str, Any]] = yaml.safe_load(f"[{specs}]")
    return loaded


def load(name: str, inputs: str = X, outputs: str = Y2) -> Model:
    return models.load(*config(f"tests.test_models:{name}", inputs, outputs))


ROWS = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)


# --- calling conventions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "factor"),
    [("Doubler", 2.0), ("make_tripler", 3.0), ("negate", -1.0), ("halver", 0.5)],
    ids=["factory class", "factory function", "plain function", "callable object"],
)
def test_one_input_is_passed_positionally_whatever_builds_the_model(
    name: str, factor: float
) -> None:
    outputs = load(name)({"x": ROWS})
    assert list(outputs) == ["y"]
    np.testing.assert_array_equal(outputs["y"], ROWS * factor)
    assert outputs["y"].dtype == np.float32


def test_several_inputs_are_passed_as_keyword_arguments() -> None:
    model = load("weighted_sum", f"{W}, {X}", Y)  # declared in another order than the function's
    weights = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32)
    outputs = model({"w": weights, "x": ROWS})
    np.testing.assert_array_equal(outputs["y"], [[1.0], [4.0], [11.0]])


@pytest.mark.parametrize("name", ["sum_and_count", "sum_and_count_by_name"],
                         ids=["tuple", "dict"])
def test_several_outputs_come_as_a_tuple_in_order_or_a_dict_by_name(name: str) -> None:
    outputs = load(name, X, TOTAL_COUNT)({"x": ROWS})
    assert list(outputs) == ["total", "count"]  # the declared order
    np.testing.assert_array_equal(outputs["total"], [[3.0], [7.0], [11.0]])
    np.testing.assert_array_equal(outputs["count"], [[2], [2], [2]])
    assert outputs["total"].dtype == np.float32 and outputs["count"].dtype == np.int64


def test_an_output_is_cast_to_its_declared_datatype() -> None:
    outputs = load("as_float64")({"x": ROWS})
    assert outputs["y"].dtype == np.float32
    np.testing.assert_array_equal(outputs["y"], ROWS + 0.25)


def test_a_torch_module_gets_tensors_in_inference_mode_and_eval() -> None:
    torch_affine.train()
    torch_affine.seen.clear()
    model = load("torch_affine", X, Y)
    outputs = model({"x": ROWS})
    assert isinstance(outputs["y"], np.ndarray) and outputs["y"].dtype == np.float32
    np.testing.assert_allclose(outputs["y"], [[21.5], [43.5], [65.5]])
    assert torch_affine.seen == [(torch.Tensor, True, False)]


def test_a_torch_module_class_is_built_and_takes_several_inputs_as_keywords() -> None:
    model = load("TorchWeightedSum", f"{X}, {W}", Y)
    outputs = model({"x": ROWS, "w": np.ones_like(ROWS)})
    np.testing.assert_array_equal(outputs["y"], [[3.0], [7.0], [11.0]])


def test_a_model_without_torch_gets_numpy_arrays() -> None:
    seen: list[type] = []

    def record(x: Any) -> Any:
        seen.append(type(x))
        return x

    runner = config("tests.test_models:negate")[1]
    Model(runner, record, torch=False)({"x": ROWS})
    assert seen == [np.ndarray]


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "outputs", "message"),
    [
        ("sum_and_count", Y2, "model returned tuple; expected outputs ['y']"),
        ("negate", TOTAL_COUNT, "model returned ndarray; expected outputs ['total', 'count']"),
        (
            "sum_and_count_by_name",
            f"{Y2}, {TOTAL_COUNT}",
            "model returned dict; expected outputs ['y', 'total', 'count']",
        ),
    ],
    ids=["too many", "too few", "a name missing from the dict"],
)
def test_outputs_that_do_not_match_the_declared_ones_raise_a_model_error(
    name: str, outputs: str, message: str
) -> None:
    model = load(name, X, outputs)
    with pytest.raises(ModelError, match="^" + re.escape(message) + "$"):
        model({"x": ROWS})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "broken_factory",
            "runners.m.model has value 'tests.test_models:broken_factory'; building it raised "
            "ValueError: no weights",
        ),
        (
            "not_a_model",
            "runners.m.model has value 'tests.test_models:not_a_model'; it names a dict, which "
            "is neither a model nor a factory of one",
        ),
        (
            "make_a_dict",
            "runners.m.model has value 'tests.test_models:make_a_dict'; it names a dict, which "
            "is neither a model nor a factory of one",
        ),
        (
            "no_such_model",
            "runners.m.model has value 'tests.test_models:no_such_model'; module "
            "'tests.test_models' has no attribute 'no_such_model'",
        ),
    ],
)
def test_a_model_that_cannot_be_built_is_a_config_error(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        load(name)
