"""`batchserve bench` on any model by its name: requests made from the model's metadata.

Each bundled runner's metadata makes a body that the server's own codec decodes against that
runner (JSON and binary alike), and the command runs on every bundled runner, by name alone,
against the real server with every request answered 200.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from batchserve.api import protocol
from batchserve.api.bench import bench, requests
from batchserve.runner.core.config import RunnerConfig, load
from tests.conftest import ROOT, Server

BUNDLED = load(ROOT / "configuration.yml").runners
RECASE = """
runners:
  recase:
    model: batchserve.runner.bundled:recase
    batching: {max_batch_size: 64, max_latency_ms: 50}
    group_by: {case: upper}
    inputs: [{name: text, datatype: BYTES, shape: [-1]}]
    outputs: [{name: recased, datatype: BYTES, shape: [-1]}]
"""


def described(runner: RunnerConfig) -> dict[str, object]:
    return dict(orjson.loads(protocol.model_metadata(runner)))


def decoded(runner: RunnerConfig, body: bytes, headers: dict[str, str]
            ) -> protocol.InferRequest:
    length = headers.get("Inference-Header-Content-Length")
    return protocol.decode_infer(body, None if length is None else int(length), runner)


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("name", list(BUNDLED))
def test_the_metadata_makes_a_request_the_runner_takes(name: str, binary: bool) -> None:
    runner = BUNDLED[name]
    body, headers = requests.request_body(described(runner), rows=3, elements=7,
                                          binary=binary)
    call = decoded(runner, body, headers)
    assert protocol.cost(call, runner) == (3 if runner.layout == "rows" else 7)
    assert len(call.outputs) == len(runner.outputs)
    assert all(output.binary == binary for output in call.outputs)


def test_strings_are_words_and_a_value_per_request_is_empty() -> None:
    runner = BUNDLED["text_features"]
    call = decoded(runner, *requests.request_body(described(runner), rows=4, seed=1))
    assert call.inputs["text"].shape == (4,)
    assert all(item and item.replace(b" ", b"").isalpha() for item in call.inputs["text"])
    assert call.inputs["separator"].tolist() == [b""]


def test_a_shape_given_replaces_the_made_one_and_an_unknown_input_is_named() -> None:
    runner = BUNDLED["mlp"]
    body, _ = requests.request_body(described(runner), shapes={"x": [2, 255]})
    assert orjson.loads(body)["inputs"][0]["shape"] == [2, 255]
    with pytest.raises(requests.RequestError,
                       match="--shape names 'y', which is not an input of model 'mlp'"):
        requests.request_body(described(runner), shapes={"y": [1, 16]})


def test_group_by_parameters_take_the_timed_value_or_must_be_given(tmp_path: Path) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(RECASE)
    runner = load(path).runners["recase"]
    document = described(runner)
    body, _ = requests.request_body(document)
    assert decoded(runner, body, {}).group == ('"upper"',)
    given, _ = requests.request_body(document, parameters={"case": "title"})
    assert decoded(runner, given, {}).group == ('"title"',)
    untimed = {**document, "parameters": {"group_by": {"case": None}}}
    with pytest.raises(requests.RequestError, match="give --parameter case=VALUE"):
        requests.request_body(untimed)


def run_bench(url: str, model: str, *extra: str, tmp_path: Path) -> dict[str, object]:
    out = tmp_path / f"{model}.json"
    argv = ["--url", url, "--model", model, "--rate", "20", "--seconds", "0.5",
            "--json", str(out), *extra]
    assert bench.main(argv) == 0
    report: dict[str, object] = json.loads(out.read_text())
    return report


@pytest.mark.parametrize("extra", [(), ("--binary", "--rows", "2", "--elements", "9")])
def test_bench_runs_on_every_bundled_runner_by_name(
    bundled: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]
) -> None:
    for name in BUNDLED:
        report = run_bench(bundled.url, name, *extra, tmp_path=tmp_path)
        (step,) = report["steps"]  # type: ignore[misc]
        assert step["ok"] > 0 and set(step["status_counts"]) == {"200"}, (name, step)
    assert capsys.readouterr().err == ""


def test_bench_runs_on_a_runner_that_groups_by_a_parameter(
    serve: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server: Server = serve(RECASE)  # type: ignore[operator]
    for extra in ((), ("--parameter", "case=title", "--binary")):
        (step,) = run_bench(server.url, "recase", *extra, tmp_path=tmp_path)["steps"]  # type: ignore[misc]
        assert step["ok"] > 0 and set(step["status_counts"]) == {"200"}, step
    assert capsys.readouterr().err == ""


def test_a_bad_override_fails_every_request_and_says_the_first_error(
    bundled: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--url", bundled.url, "--model", "iris_clf", "--shape", "input=3,5", "--rate", "20",
            "--seconds", "0.5"]
    assert bench.main(argv) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == ("batchserve bench: every request failed; the first answer: 400 "
                    '{"error":"input \'input\' has shape [3, 5]; expected [-1, 4]"}')
