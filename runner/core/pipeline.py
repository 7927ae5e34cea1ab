"""The `pipelines:` section of `configuration.yml`: runners chained behind one model name.

A pipeline is a list of steps, each a runner, with one latency limit for the whole chain.
Tensors flow by name, as in Triton's ensembles: a step's `input_map` says which tensor each of
its inputs reads (step input -> pipeline tensor; by default the input's own name), its
`output_map` under which name each of its outputs is known to later steps and to the answer
(step output -> pipeline tensor; by default the output's own name). A tensor no earlier step
makes is one the request brings. The answer holds `outputs`, by default the last step's.

Everything is checked here, before anything starts, so a chain that could not run is refused
with one line naming the dotted key: a step names a runner, reads only what the request or an
earlier step makes (so there are no cycles), in the datatype and shape it was made in, and no
tensor is made twice. The pipeline also gets a `RunnerConfig` of its own (`facade`), holding
the request's inputs and the answer's outputs under the pipeline's name and limit: what the
API decodes a request against, encodes an answer with and describes in metadata, exactly as
for a runner; its `group_by` is every step's, so a request brings the parameters each
step's runner batches by. Nothing here knows of the API; runners never learn they are steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .runner_config import Batching, ConfigError, RunnerConfig, TensorSpec

__all__ = ["PipelineConfig", "Step", "parse_pipelines"]


@dataclass(frozen=True, slots=True)
class Step:
    """One runner of a chain, and where its tensors come from and go."""

    runner: str
    inputs: tuple[tuple[str, str], ...]
    """Each input of the runner, with the pipeline tensor it reads."""
    outputs: tuple[tuple[str, str], ...]
    """Each output of the runner, with the pipeline tensor it makes."""


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """A chain of runners served as one model, answering within `max_latency_ms`."""

    name: str
    max_latency_ms: float
    steps: tuple[Step, ...]
    facade: RunnerConfig
    """The pipeline as a model: the request's inputs, the answer's outputs, its limit."""

    @property
    def runners(self) -> tuple[str, ...]:
        return tuple(step.runner for step in self.steps)

    def group_of(self, runner: RunnerConfig, values: tuple[str, ...]) -> tuple[str, ...]:
        """A step's `group_by` values, out of the request's `values` for the whole chain
        (in the order of `facade.group_by`, as the request's parameters were decoded)."""
        names = self.facade.group_by
        return tuple(values[names.index(name)] for name in runner.group_by)


PIPELINE_KEYS = {"max_latency_ms", "steps", "outputs"}
STEP_KEYS = {"runner", "input_map", "output_map"}


def _fail(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key} has value {value!r}; it must be {expected}")


def _mapping(key: str, value: Any, allowed: set[str] | None = None) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(key, value, "a mapping")
    for name in value:
        if allowed is not None and name not in allowed:
            known = ", ".join(sorted(allowed))
            raise ConfigError(f"{key}.{name} is not a known key; known keys are: {known}")
    return value


def _name(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(key, value, "a non-empty string")
    return value


def _shape_text(spec: TensorSpec) -> str:
    return f"{spec.datatype} [{', '.join(map(str, spec.shape))}]"


def _agree(made: TensorSpec, read: TensorSpec) -> bool:
    """Whether a tensor made as `made` fits an input declared `read` (-1 matches any size)."""
    if made.datatype != read.datatype or len(made.shape) != len(read.shape):
        return False
    return all(a == b or -1 in (a, b) for a, b in zip(made.shape, read.shape, strict=True))


@dataclass(slots=True)
class _Tensors:
    """What the chain knows so far while its steps are read in order: each tensor a step made
    (with where), and each the request brings (with the first step that reads it)."""

    made: dict[str, tuple[TensorSpec, str]]
    requested: dict[str, tuple[TensorSpec, str, RunnerConfig]]


def _read(key: str, where: str, runner: RunnerConfig, spec: TensorSpec, source: str,
          known: _Tensors) -> None:
    """Check that input `spec` of step `where` can read tensor `source`."""
    if source in known.made:
        made, maker = known.made[source]
        if not _agree(made, spec):
            raise ConfigError(
                f"{key} has value {source!r}; {maker} makes it as {_shape_text(made)}, but "
                f"runner {runner.name!r} takes input {spec.name!r} as {_shape_text(spec)}"
            )
        return
    if source in known.requested:
        first, reader, _ = known.requested[source]
        if first.datatype != spec.datatype or first.shape != spec.shape:
            raise ConfigError(
                f"{key} has value {source!r}; the request's {source!r} is read by {reader} "
                f"as {_shape_text(first)}, but runner {runner.name!r} takes input "
                f"{spec.name!r} as {_shape_text(spec)}"
            )
        return
    known.requested[source] = (spec, where, runner)


def _step(key: str, value: Any, runners: Mapping[str, RunnerConfig],
          pipelines: Mapping[str, Any], known: _Tensors, where: str) -> Step:
    raw = _mapping(key, value, STEP_KEYS)
    if "runner" not in raw:
        raise ConfigError(f"{key}.runner is missing")
    name = raw["runner"]
    if name in pipelines and name not in runners:  # a name of both is refused as such
        raise _fail(f"{key}.runner", name, "the name of a runner (a step cannot be a pipeline)")
    if name not in runners:
        raise _fail(f"{key}.runner", name, "the name of a runner: " + ", ".join(runners))
    runner = runners[name]
    inputs = _input_map(f"{key}.input_map", raw.get("input_map", {}), runner, known, where)
    outputs = _output_map(f"{key}.output_map", raw.get("output_map", {}), runner, known, where)
    return Step(name, inputs, outputs)


def _tensor_map(key: str, value: Any, runner: RunnerConfig, kind: str,
                specs: tuple[TensorSpec, ...]) -> Mapping[str, Any]:
    """A step's `input_map` or `output_map`, each key one of the runner's `kind`s (`specs`)."""
    given = _mapping(key, value)
    names = [spec.name for spec in specs]
    for name in given:
        if name not in names:
            raise ConfigError(f"{key}.{name} is not an {kind} of runner {runner.name!r}; its "
                              f"{kind}s are: {', '.join(names)}")
    return given


def _input_map(key: str, value: Any, runner: RunnerConfig, known: _Tensors, where: str
               ) -> tuple[tuple[str, str], ...]:
    given = _tensor_map(key, value, runner, "input", runner.inputs)
    pairs = []
    for spec in runner.inputs:
        if spec.name in given:
            source = _name(f"{key}.{spec.name}", given[spec.name])
            at = f"{key}.{spec.name}"
        else:
            source, at = spec.name, f"{key}.{spec.name} (by default its own name)"
        _read(at, where, runner, spec, source, known)
        pairs.append((spec.name, source))
    return tuple(pairs)


def _output_map(key: str, value: Any, runner: RunnerConfig, known: _Tensors, where: str
                ) -> tuple[tuple[str, str], ...]:
    given = _tensor_map(key, value, runner, "output", runner.outputs)
    pairs = []
    for spec in runner.outputs:
        target = _name(f"{key}.{spec.name}", given.get(spec.name, spec.name))
        at = f"{key}.{spec.name}" if spec.name in given else (
            f"{key}.{spec.name} (by default its own name)")
        if target in known.made:
            raise ConfigError(f"{at} has value {target!r}, which {known.made[target][1]} "
                              "makes already; each tensor must be made once")
        if target in known.requested and known.requested[target][1] == where:
            raise ConfigError(
                f"{at} has value {target!r}, the name of a tensor this step reads from the "
                "request; each tensor is made once: give the output another name in output_map")
        if target in known.requested:
            reader = known.requested[target][1]
            raise ConfigError(
                f"{at} has value {target!r}, which {reader} reads before this step runs; a "
                "step reads only the request and earlier steps (the steps run in order, "
                "without cycles)")
        known.made[target] = (replace(spec, name=target), f"{where} (runner {runner.name!r})")
        pairs.append((spec.name, target))
    return tuple(pairs)


def _outputs(key: str, value: Any, steps: tuple[Step, ...], known: _Tensors
             ) -> tuple[str, ...]:
    if value is None:
        return tuple(target for _, target in steps[-1].outputs)
    if not isinstance(value, list) or not value:
        raise _fail(key, value, "a non-empty list of tensor names")
    names = []
    for i, item in enumerate(value):
        name = _name(f"{key}[{i}]", item)
        if name not in known.made:
            raise _fail(f"{key}[{i}]", name, "a tensor a step makes: " + ", ".join(known.made))
        if name in names:
            raise ConfigError(f"{key}[{i}] has value {name!r}, named twice")
        names.append(name)
    return tuple(names)


def _facade(key: str, name: str, limit_ms: float, steps: tuple[Step, ...],
            outputs: tuple[str, ...], known: _Tensors,
            runners: Mapping[str, RunnerConfig]) -> RunnerConfig:
    """The pipeline as one model, for decoding, encoding and metadata. The request's inputs
    must batch alike (one layout, one batch dimension): they are decoded and counted as one
    request before the first step runs."""
    requested = list(known.requested.items())
    if not requested:
        raise ConfigError(f"{key}.steps reads nothing from the request; the first step must "
                          "read at least one tensor the request brings")
    _, (_, first_where, first) = requested[0]
    for source, (spec, where, runner) in requested[1:]:
        if spec.layout != requested[0][1][0].layout or runner.batch_dim[0] != first.batch_dim[0]:
            raise ConfigError(
                f"{key}.steps: the request's {source!r}, read by {where}, batches unlike "
                f"{requested[0][0]!r}, read by {first_where} (its layout or batch dimension "
                "differs); a request's inputs must batch alike")
    last = runners[steps[-1].runner]
    chained = [runners[step.runner] for step in steps]
    group_by = tuple(dict.fromkeys(name for runner in chained for name in runner.group_by))
    timed = {name: value for runner in reversed(chained) for name, value in runner.group_timing}
    return RunnerConfig(
        name=name,
        model=f"pipeline:{name}",
        inputs=tuple(replace(spec, name=source) for source, (spec, _, _) in requested),
        outputs=tuple(known.made[out][0] for out in outputs),
        batching=Batching(max_batch_size=first.batching.max_batch_size, max_latency_ms=limit_ms,
                          max_batch_elements=first.batching.max_batch_elements),
        batch_dim=(first.batch_dim[0], last.batch_dim[1]),
        group_by=group_by,
        group_timing=tuple((name, timed[name]) for name in group_by if name in timed),
    )


def _limit(key: str, value: Any) -> float:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not value > 0 or value == float("inf"):
        raise _fail(key, value, "a positive number")
    return float(value)


def _pipeline(key: str, name: str, value: Any, runners: Mapping[str, RunnerConfig],
              pipelines: Mapping[str, Any]) -> PipelineConfig:
    raw = _mapping(key, value, PIPELINE_KEYS)
    for required in ("max_latency_ms", "steps"):
        if required not in raw:
            raise ConfigError(f"{key}.{required} is missing")
    limit_ms = _limit(f"{key}.max_latency_ms", raw["max_latency_ms"])
    listed = raw["steps"]
    if not isinstance(listed, list) or not listed:
        raise _fail(f"{key}.steps", listed, "a non-empty list of steps {runner, input_map?, "
                    "output_map?}")
    known = _Tensors({}, {})
    steps = tuple(_step(f"{key}.steps[{i}]", item, runners, pipelines, known, f"steps[{i}]")
                  for i, item in enumerate(listed))
    outputs = _outputs(f"{key}.outputs", raw.get("outputs"), steps, known)
    facade = _facade(key, name, limit_ms, steps, outputs, known, runners)
    return PipelineConfig(name, limit_ms, steps, facade)


def parse_pipelines(value: Any, runners: Mapping[str, RunnerConfig]
                    ) -> dict[str, PipelineConfig]:
    """The `pipelines` section (absent: none), checked against the runners it chains."""
    if value is None:
        return {}
    raw = _mapping("pipelines", value)
    parsed = {}
    for name, item in raw.items():
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise _fail("pipelines", name, "keyed by names of letters, digits, '_' and '-'")
        parsed[name] = _pipeline(f"pipelines.{name}", name, item, runners, raw)
        if name in runners:
            raise ConfigError(f"pipelines.{name} has the name of a runner; a model name in "
                              "URLs must be one runner's or one pipeline's")
    return parsed
