"""The `pipelines:` section: each rule refused with one line naming the dotted key, and the
pipeline's own model (its facade) made from the steps it chains."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from batchserve.runner.core.config import ConfigError, load
from tests.conftest import BATCHSERVE

RUNNERS = """
runners:
  first:
    model: fixture_models:slow_echo
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
  second:
    model: fixture_models:slow_echo
    inputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: scores, datatype: FP32, shape: [-1, 4]}]
  ints:
    model: fixture_models:slow_echo
    inputs: [{name: ids, datatype: INT64, shape: [-1, 4]}]
    outputs: [{name: out, datatype: INT64, shape: [-1, 4]}]
  grouped:
    model: fixture_models:scaled
    group_by: [factor]
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""


def config(pipelines: str) -> str:
    return RUNNERS + "pipelines:\n" + pipelines


CHAIN = config("""
  chain:
    max_latency_ms: 100
    steps:
      - {runner: first}
      - {runner: second}
""")

BAD = {
    "unknown runner": (
        CHAIN.replace("{runner: second}", "{runner: nope}"),
        "pipelines.chain.steps[1].runner has value 'nope'; it must be the name of a runner: "
        "first, second, ints, grouped",
    ),
    "a step that is a pipeline": (
        CHAIN + "  outer:\n    max_latency_ms: 100\n    steps: [{runner: chain}]\n",
        "pipelines.outer.steps[0].runner has value 'chain'; it must be the name of a runner "
        "(a step cannot be a pipeline)",
    ),
    "name of a runner": (
        CHAIN.replace("  chain:", "  first:"),
        "pipelines.first has the name of a runner; a model name in URLs must be one runner's "
        "or one pipeline's",
    ),
    "datatypes that do not line up": (
        CHAIN.replace("{runner: second}", "{runner: ints, input_map: {ids: y}}"),
        "pipelines.chain.steps[1].input_map.ids has value 'y'; steps[0] (runner 'first') makes "
        "it as FP32 [-1, 4], but runner 'ints' takes input 'ids' as INT64 [-1, 4]",
    ),
    "an input no earlier step makes (a cycle)": (
        CHAIN.replace("- {runner: first}\n      - {runner: second}",
                      "- {runner: second}\n      - {runner: first}"),
        "pipelines.chain.steps[1].output_map.y (by default its own name) has value 'y', which "
        "steps[0] reads before this step runs; a step reads only the request and earlier "
        "steps (the steps run in order, without cycles)",
    ),
    "an output named as the request tensor it reads": (
        RUNNERS.replace("outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]",
                        "outputs: [{name: x, datatype: FP32, shape: [-1, 4]}]", 1)
        + "pipelines:\n  echo:\n    max_latency_ms: 100\n    steps: [{runner: first}]\n",
        "pipelines.echo.steps[0].output_map.x (by default its own name) has value 'x', the name "
        "of a tensor this step reads from the request; each tensor is made once: give the "
        "output another name in output_map",
    ),
    "a tensor made twice": (
        CHAIN.replace("{runner: second}", "{runner: first, input_map: {x: y}}"),
        "pipelines.chain.steps[1].output_map.y (by default its own name) has value 'y', which "
        "steps[0] (runner 'first') makes already; each tensor must be made once",
    ),
    "an unknown input in input_map": (
        CHAIN.replace("{runner: second}", "{runner: second, input_map: {tokens: y}}"),
        "pipelines.chain.steps[1].input_map.tokens is not an input of runner 'second'; its "
        "inputs are: y",
    ),
    "an unknown output in output_map": (
        CHAIN.replace("{runner: second}", "{runner: second, output_map: {y: z}}"),
        "pipelines.chain.steps[1].output_map.y is not an output of runner 'second'; its "
        "outputs are: scores",
    ),
    "an output nobody makes": (
        CHAIN + "    outputs: [scores, logits]\n",
        "pipelines.chain.outputs[1] has value 'logits'; it must be a tensor a step makes: "
        "y, scores",
    ),
    "request tensors read in two datatypes": (
        CHAIN.replace("{runner: second}", "{runner: ints, input_map: {ids: x}}"),
        "pipelines.chain.steps[1].input_map.ids has value 'x'; the request's 'x' is read by "
        "steps[0] as FP32 [-1, 4], but runner 'ints' takes input 'ids' as INT64 [-1, 4]",
    ),
    "no limit": (
        CHAIN.replace("    max_latency_ms: 100\n", ""),
        "pipelines.chain.max_latency_ms is missing",
    ),
    "a negative limit": (
        CHAIN.replace("max_latency_ms: 100", "max_latency_ms: -5"),
        "pipelines.chain.max_latency_ms has value -5; it must be a positive number",
    ),
    "no steps": (
        CHAIN.replace("    steps:\n      - {runner: first}\n      - {runner: second}\n",
                      "    steps: []\n"),
        "pipelines.chain.steps has value []; it must be a non-empty list of steps {runner, "
        "input_map?, output_map?}",
    ),
    "an unknown key": (
        CHAIN.replace("{runner: second}", "{runner: second, inputs: [y]}"),
        "pipelines.chain.steps[1].inputs is not a known key; known keys are: input_map, "
        "output_map, runner",
    ),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_each_rule_is_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    text, message = BAD[kind]
    path = tmp_path / "configuration.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == message


@pytest.mark.parametrize("flag", [False, True])
def test_validate_says_the_line_and_takes_config_as_serve_does(tmp_path: Path,
                                                                 flag: bool) -> None:
    text, message = BAD["datatypes that do not line up"]
    path = tmp_path / "configuration.yml"
    path.write_text(text)
    args = ["--config", str(path)] if flag else [str(path)]
    result = subprocess.run([BATCHSERVE, "validate", *args], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert (result.returncode, result.stdout) == (3, "")
    assert result.stderr == f"error: {message}\n"


def test_validate_names_the_pipelines(tmp_path: Path) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(CHAIN)
    (tmp_path / "fixture_models.py").write_text(
        (Path(__file__).parent / "fixture_models.py").read_text())
    result = subprocess.run([BATCHSERVE, "validate", "--config", str(path)], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"{path}: valid (4 runner(s): first, second, ints, grouped; "
                             "1 pipeline(s): chain)\n")


def test_the_facade_holds_the_request_inputs_and_the_answer_outputs(tmp_path: Path) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(CHAIN.replace("{runner: second}",
                                  "{runner: second, output_map: {scores: answer}}"))
    pipeline = load(path).pipelines["chain"]
    assert pipeline.runners == ("first", "second")
    assert pipeline.steps[1].inputs == (("y", "y"),)
    assert pipeline.steps[1].outputs == (("scores", "answer"),)
    facade = pipeline.facade
    assert facade.name == "chain"
    assert [(s.name, s.datatype, s.shape) for s in facade.inputs] == [("x", "FP32", (-1, 4))]
    assert [(s.name, s.datatype, s.shape) for s in facade.outputs] == [
        ("answer", "FP32", (-1, 4))]
    assert facade.batching.max_latency_ms == 100


def test_an_output_list_chooses_what_the_answer_holds(tmp_path: Path) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(CHAIN + "    outputs: [y, scores]\n")
    facade = load(path).pipelines["chain"].facade
    assert [spec.name for spec in facade.outputs] == ["y", "scores"]


def test_a_step_batching_by_parameters_makes_the_request_bring_them(tmp_path: Path) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(CHAIN.replace("{runner: first}", "{runner: grouped}"))
    loaded = load(path)
    pipeline = loaded.pipelines["chain"]
    assert pipeline.facade.group_by == ("factor",)
    grouped, second = loaded.runners["grouped"], loaded.runners["second"]
    assert pipeline.group_of(grouped, ("2.0",)) == ("2.0",)
    assert pipeline.group_of(second, ("2.0",)) == ()
