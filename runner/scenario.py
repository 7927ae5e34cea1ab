"""Scenario files for the simulator: reading, checking and typing them (issue #3).

A scenario is the traffic and the model cost that `runner.simulate` plays on its virtual clock.
It is read with `yaml.safe_load` into frozen values; an error names the dotted path, the value
and what was expected.

A scenario file:

    slo_ms: 100
    max_batch_size: 64
    seed: 1
    cost: {intercept_ms: 5, per_item_ms: 0.5, noise: 0.05}
    request_size: 1            # or {min: 1, max: 8}
    phases:
      - {seconds: 20, rate: 200}
      - {seconds: 20, rate: 300, cost: {intercept_ms: 10, per_item_ms: 1.0}}

A phase's `cost` overrides the given keys from the phase's start on, for later phases too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml


class ScenarioError(ValueError):
    """A scenario file is missing a key, has an unknown one, or a value out of range."""


@dataclass(frozen=True, slots=True)
class Cost:
    intercept_ms: float
    per_item_ms: float
    noise: float = 0.0

    def mean_s(self, rows: int) -> float:
        return (self.intercept_ms + self.per_item_ms * rows) / 1000.0


@dataclass(frozen=True, slots=True)
class Phase:
    seconds: float
    rate: float
    cost: Cost


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    slo_ms: float
    max_batch_size: int
    seed: int
    size_min: int
    size_max: int
    phases: tuple[Phase, ...]

    @property
    def seconds(self) -> float:
        return sum(phase.seconds for phase in self.phases)


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"cannot read scenario {str(path)!r}: {exc}") from exc
    return parse_scenario(data, path.stem)


def parse_scenario(data: Any, name: str = "scenario") -> Scenario:
    top = _mapping(data, name, {"slo_ms", "max_batch_size", "seed", "cost", "request_size",
                                "phases", "description"})
    cost = _cost(top.get("cost"), f"{name}.cost", None)
    size_min, size_max = _request_size(top.get("request_size", 1), f"{name}.request_size")
    max_batch_size = int(_number(top.get("max_batch_size", 64), f"{name}.max_batch_size", 1))
    if size_max > max_batch_size:
        raise ScenarioError(
            f"{name}.request_size has maximum {size_max}; it must not exceed max_batch_size"
        )
    raw_phases = top.get("phases")
    if not isinstance(raw_phases, list) or not raw_phases:
        raise ScenarioError(f"{name}.phases has value {raw_phases!r}; it must be a non-empty list")
    phases = []
    for index, raw in enumerate(raw_phases):
        where = f"{name}.phases[{index}]"
        entry = _mapping(raw, where, {"seconds", "rate", "cost"})
        if "cost" in entry:
            cost = _cost(entry["cost"], f"{where}.cost", cost)
        seconds = _number(entry.get("seconds"), f"{where}.seconds", 0.0, strict=True)
        rate = _number(entry.get("rate"), f"{where}.rate", 0.0)
        phases.append(Phase(seconds, rate, cost))
    return Scenario(
        name=name,
        slo_ms=_number(top.get("slo_ms", 100), f"{name}.slo_ms", 0.0, strict=True),
        max_batch_size=max_batch_size,
        seed=int(_number(top.get("seed", 1), f"{name}.seed", 0)),
        size_min=size_min,
        size_max=size_max,
        phases=tuple(phases),
    )


def _mapping(value: Any, where: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{where} has value {value!r}; it must be a mapping")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ScenarioError(f"{where} has unknown key {unknown[0]!r}; known: {sorted(allowed)}")
    return value


def _number(value: Any, where: str, low: float, *, strict: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        bound = f"greater than {low:g}" if strict else f"at least {low:g}"
        raise ScenarioError(f"{where} has value {value!r}; it must be a number {bound}")
    return float(value)


def _cost(value: Any, where: str, base: Cost | None) -> Cost:
    entry = _mapping(value, where, {"intercept_ms", "per_item_ms", "noise"})
    fields = {} if base is None else asdict(base)
    for key in ("intercept_ms", "per_item_ms", "noise"):
        if key in entry:
            fields[key] = _number(entry[key], f"{where}.{key}", 0.0)
        elif key != "noise" and base is None:
            raise ScenarioError(f"{where}.{key} is missing; it must be a number at least 0")
    return Cost(**fields)


def _request_size(value: Any, where: str) -> tuple[int, int]:
    if isinstance(value, Mapping):
        entry = _mapping(value, where, {"min", "max"})
        low = int(_number(entry.get("min"), f"{where}.min", 1))
        high = int(_number(entry.get("max"), f"{where}.max", low))
        return low, high
    size = int(_number(value, where, 1))
    return size, size
