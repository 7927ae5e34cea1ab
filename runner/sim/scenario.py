"""Scenario files for the simulator: reading, checking and typing them.

A scenario is the traffic and the model cost that `batchserve.runner.sim.simulate` plays on its
virtual clock. It is read with `yaml.safe_load` into frozen values; an error names the dotted
path, the value and what was expected.

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
A pipeline's scenario may give its runners costs of their own (`batchserve simulate
--pipeline`): `runners: {tokenize: {intercept_ms: 0.2, per_item_ms: 0.05}}` overrides the given
keys of each phase's cost for that runner; a runner not named there costs what `cost` says.

The cost of a batch is the model's CPU time: `intercept_ms + per_item_ms * rows` times a
lognormal factor of sigma `noise`, or a batch drawn from a recording (`replay: FILE`, a path
relative to the scenario file; it replaces the three keys above). What the batch takes on the
clock, its wall time, is that cost inflated by what a shared machine adds:

    cost:
      contention: {per_krps: 0.5, window_ms: 100}  # wall * (1 + 0.5 * arrivals per ms lately)
      tail: {share: 0.05, scale: 2.0, alpha: 3}     # 5% of batches: wall * 2 * Pareto(3)
      stalls: {probability: 0.002, ms: 200}         # 0.2% of batches: wall + 200 ms

`batchserve.runner.sim.batch_times` applies them; docs/dispatcher.md, "The simulator", gives the
laws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from .recording import Recording, RecordingError, load_recording


class ScenarioError(ValueError):
    """A scenario file is missing a key, has an unknown one, or a value out of range."""


@dataclass(frozen=True, slots=True)
class Contention:
    """Shared cores: wall = cost * (1 + per_krps * arrivals per millisecond over `window_ms`)."""

    per_krps: float
    window_ms: float = 100.0


@dataclass(frozen=True, slots=True)
class Tail:
    """A heavy tail: a `share` of batches take `scale * Pareto(alpha)` times longer (>= scale)."""

    share: float
    scale: float
    alpha: float = 3.0


@dataclass(frozen=True, slots=True)
class Stalls:
    """A batch stalls with `probability`, and its wall time then gains `ms` milliseconds."""

    probability: float
    ms: float


@dataclass(frozen=True, slots=True)
class Cost:
    intercept_ms: float
    per_item_ms: float
    noise: float = 0.0
    replay: Recording | None = None
    contention: Contention | None = None
    tail: Tail | None = None
    stalls: Stalls | None = None

    def mean_s(self, rows: float) -> float:
        """The mean batch time in seconds; `rows` may be fractional (an expected count)."""
        return (self.intercept_ms + self.per_item_ms * rows) / 1000.0

    @property
    def inflated(self) -> bool:
        """Whether wall time can differ from the cost: without these keys they are equal."""
        return bool(self.replay or self.contention or self.tail or self.stalls)


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
    runners: tuple[tuple[str, tuple[Cost, ...]], ...] = ()
    """Runners' own costs, each phase by phase (a pipeline's steps): see `costs_of`."""

    @property
    def seconds(self) -> float:
        return sum(phase.seconds for phase in self.phases)

    def costs_of(self, runner: str) -> tuple[Cost, ...]:
        """A runner's cost in each phase: its own (`runners`), else the phases'."""
        own = dict(self.runners).get(runner)
        return own if own is not None else tuple(phase.cost for phase in self.phases)


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"cannot read scenario {str(path)!r}: {exc}") from exc
    return parse_scenario(data, path.stem, path.parent)


def parse_scenario(data: Any, name: str = "scenario", folder: str | Path = ".") -> Scenario:
    """Check and type a scenario; `folder` is where a `replay` path is relative to."""
    top = _mapping(data, name, {"slo_ms", "max_batch_size", "seed", "cost", "request_size",
                                "phases", "description", "runners"})
    folder = Path(folder)
    cost = _cost(top.get("cost"), f"{name}.cost", None, folder)
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
            cost = _cost(entry["cost"], f"{where}.cost", cost, folder)
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
        runners=_runner_costs(top.get("runners", {}), f"{name}.runners", phases, folder),
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


def _share(value: Any, where: str) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not 0.0 <= value <= 1.0:
        raise ScenarioError(f"{where} has value {value!r}; it must be a number from 0 to 1")
    return float(value)


SYNTHETIC = ("intercept_ms", "per_item_ms", "noise")


def _cost(value: Any, where: str, base: Cost | None, folder: Path) -> Cost:
    """A cost mapping; over `base` (the cost in force before a phase) it overrides given keys.

    `replay` and the synthetic keys exclude each other: giving one group in a phase switches
    the cost to it from that phase on.
    """
    entry = _mapping(value, where, {*SYNTHETIC, "replay", "contention", "tail", "stalls"})
    synthetic = [key for key in SYNTHETIC if key in entry]
    if "replay" in entry and synthetic:
        raise ScenarioError(
            f"{where} has keys 'replay' and {synthetic[0]!r}; a replayed cost takes neither "
            "intercept_ms, per_item_ms nor noise"
        )
    cost = Cost(0.0, 0.0) if base is None else base
    if "replay" in entry:
        cost = replace(cost, replay=_replay(entry["replay"], f"{where}.replay", folder))
    elif synthetic or base is None:
        for key in ("intercept_ms", "per_item_ms"):
            if key not in entry and (base is None or base.replay is not None):
                raise ScenarioError(f"{where}.{key} is missing; it must be a number at least 0")
        numbers: dict[str, Any] = {
            key: _number(entry[key], f"{where}.{key}", 0.0) for key in synthetic
        }
        cost = replace(cost, replay=None, **numbers)
    for key, parse in _INFLATIONS.items():
        if key in entry:
            cost = replace(cost, **{key: parse(entry[key], f"{where}.{key}")})
    return cost


def _runner_costs(value: Any, where: str, phases: list[Phase], folder: Path
                  ) -> tuple[tuple[str, tuple[Cost, ...]], ...]:
    """Each named runner's cost phase by phase: its keys over the phase's cost."""
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{where} has value {value!r}; it must be a mapping of runner "
                            "names to costs")
    return tuple(
        (str(runner), tuple(_cost(cost, f"{where}.{runner}", phase.cost, folder)
                            for phase in phases))
        for runner, cost in value.items())


def _replay(value: Any, where: str, folder: Path) -> Recording:
    if not isinstance(value, str) or not value:
        raise ScenarioError(f"{where} has value {value!r}; it must be the path of a batch log")
    try:
        return load_recording(folder / value)
    except RecordingError as exc:
        raise ScenarioError(
            f"{where} has value {value!r}; it must name a batch log with header "
            f"rows,wall_s,cpu_s relative to the scenario file ({exc})"
        ) from exc


def _contention(value: Any, where: str) -> Contention:
    entry = _mapping(value, where, {"per_krps", "window_ms"})
    return Contention(
        per_krps=_number(entry.get("per_krps"), f"{where}.per_krps", 0.0),
        window_ms=_number(entry.get("window_ms", 100.0), f"{where}.window_ms", 0.0, strict=True),
    )


def _tail(value: Any, where: str) -> Tail:
    entry = _mapping(value, where, {"share", "scale", "alpha"})
    return Tail(
        share=_share(entry.get("share"), f"{where}.share"),
        scale=_number(entry.get("scale"), f"{where}.scale", 1.0),
        alpha=_number(entry.get("alpha", 3.0), f"{where}.alpha", 0.0, strict=True),
    )


def _stalls(value: Any, where: str) -> Stalls:
    entry = _mapping(value, where, {"probability", "ms"})
    return Stalls(
        probability=_share(entry.get("probability"), f"{where}.probability"),
        ms=_number(entry.get("ms"), f"{where}.ms", 0.0),
    )


_INFLATIONS: dict[str, Callable[[Any, str], Any]] = {
    "contention": _contention,
    "tail": _tail,
    "stalls": _stalls,
}


def _request_size(value: Any, where: str) -> tuple[int, int]:
    if isinstance(value, Mapping):
        entry = _mapping(value, where, {"min", "max"})
        low = int(_number(entry.get("min"), f"{where}.min", 1))
        high = int(_number(entry.get("max"), f"{where}.max", low))
        return low, high
    size = int(_number(value, where, 1))
    return size, size
