"""Ragged and pad inputs end to end: the real server, runner processes and torch model."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from batchserve.api.client import ModelClient
from batchserve.runner.text_model import VOCAB, RaggedText
from tests.conftest import ROOT, Server, start_server
from tests.test_server import histogram

CONFIG = """
api: {workers: 2}
runners:
  text:
    model: batchserve.runner.text_model:RaggedText
    batching: {max_batch_size: 64, max_batch_elements: 4096, max_latency_ms: 2000}
    inputs: [{name: tokens, datatype: INT64, shape: [-1], ragged: true}]
    batch_inputs: [{kind: accumulated_element_count, name: offsets, source: tokens}]
    outputs: [{name: scores, datatype: FP32, shape: [-1, 4]}]
  text_pad:
    model: batchserve.runner.text_model:PaddedText
    batching: {max_batch_size: 64, max_batch_elements: 4096, max_latency_ms: 2000}
    inputs: [{name: tokens, datatype: INT64, shape: [-1], pad: {value: 0}}]
    batch_inputs: [{kind: element_count, name: lengths, source: tokens}]
    outputs: [{name: scores, datatype: FP32, shape: [-1, 4]}]
  sums:
    model: fixture_models:ragged_sums
    batching: {max_batch_size: 8, max_batch_elements: 40, max_latency_ms: 2000}
    inputs: [{name: tokens, datatype: INT64, shape: [-1], ragged: true}]
    batch_inputs:
      - {kind: accumulated_element_count, name: ends, source: tokens}
      - {kind: element_count, name: counts, source: tokens}
      - {kind: accumulated_element_count_with_zero, name: bounds, source: tokens}
    outputs:
      - {name: sum, datatype: INT64, shape: [-1, 1]}
      - {name: length, datatype: INT64, shape: [-1, 1]}
  sums_pad:
    model: fixture_models:padded_sums
    batching: {max_batch_size: 8, max_batch_elements: 40, max_latency_ms: 2000}
    inputs: [{name: tokens, datatype: INT64, shape: [-1], pad: {value: -7}}]
    batch_inputs: [{kind: element_count, name: lengths, source: tokens}]
    outputs:
      - {name: sum, datatype: INT64, shape: [-1, 1]}
      - {name: length, datatype: INT64, shape: [-1, 1]}
  slow_sums:
    model: fixture_models:slow_ragged_sums
    batching: {max_batch_size: 8, max_batch_elements: 200, max_latency_ms: 100}
    inputs: [{name: tokens, datatype: INT64, shape: [-1], ragged: true}]
    batch_inputs: [{kind: accumulated_element_count, name: ends, source: tokens}]
    outputs: [{name: sum, datatype: INT64, shape: [-1, 1]}]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    folder = tmp_path_factory.mktemp("ragged")
    (folder / "configuration.yml").write_text(CONFIG)
    shutil.copy(ROOT / "tests" / "fixture_models.py", folder / "fixture_models.py")
    running = start_server(folder / "configuration.yml")
    yield running, folder / "batches.log"
    running.stop()


def body(tokens: np.ndarray) -> dict[str, Any]:
    shape = [len(tokens)]
    return {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": shape,
                        "data": tokens.tolist()}]}


def send_all(url: str, model: str, requests: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every request at once, each on its own connection; the outputs of each, in order."""

    async def post(client: httpx.AsyncClient, tokens: np.ndarray) -> dict[str, np.ndarray]:
        answer = await client.post(f"/v2/models/{model}/infer", json=body(tokens))
        assert answer.status_code == 200, answer.text
        return {out["name"]: np.array(out["data"]).reshape(out["shape"])
                for out in answer.json()["outputs"]}

    async def run() -> list[dict[str, np.ndarray]]:
        limits = httpx.Limits(max_connections=len(requests))
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            return list(await asyncio.gather(*(post(client, t) for t in requests)))

    return asyncio.run(run())


def mixed_lengths(count: int, longest: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(n)) for n in rng.integers(1, longest + 1, count)]


def alone(model: RaggedText, tokens: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(tokens), torch.tensor([len(tokens)])).numpy()


def batch_rows(server: Server, runner: str) -> tuple[float, float]:
    """How many batches `runner` has run and how many rows they held, from /metrics."""
    page = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = histogram(page, "batchserve_adaptive_batch_size", runner=runner)
    return found.get("_count", 0.0), found.get("_sum", 0.0)


def test_concurrent_ragged_requests_get_exactly_their_answer_alone(
    server: tuple[Server, Path],
) -> None:
    running, _ = server
    requests = mixed_lengths(300, 200, seed=1)
    before = batch_rows(running, "text")
    answers = send_all(running.url, "text", requests)
    model = RaggedText()
    for tokens, answer in zip(requests, answers, strict=True):
        assert answer["scores"].shape == (1, 4)
        np.testing.assert_array_equal(answer["scores"].astype(np.float32), alone(model, tokens))
    batches, rows = (after - first for after, first in zip(
        batch_rows(running, "text"), before, strict=True))
    assert rows == 300
    assert batches < 300, "every request ran alone: no batch was formed"


def test_the_pad_runner_answers_exactly_as_the_ragged_one(server: tuple[Server, Path]) -> None:
    running, _ = server
    requests = mixed_lengths(200, 120, seed=2)
    ragged_answers = send_all(running.url, "text", requests)
    padded_answers = send_all(running.url, "text_pad", requests)
    for ragged_answer, padded_answer in zip(ragged_answers, padded_answers, strict=True):
        np.testing.assert_array_equal(ragged_answer["scores"], padded_answer["scores"])
    batches, rows = batch_rows(running, "text_pad")
    assert rows == 200 and batches < 200


def logged(log: Path, layout: str) -> list[list[int]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [list(map(int, line.split()[1:])) for line in lines if line.startswith(layout)]


@pytest.mark.parametrize(("model", "layout"), [("sums", "ragged"), ("sums_pad", "pad")])
def test_batch_inputs_and_both_caps_as_documented(
    server: tuple[Server, Path], model: str, layout: str
) -> None:
    """The model finds each request by its batch inputs (it checks they agree), and no batch
    holds more than max_batch_size (8) requests or max_batch_elements (40) elements."""
    running, log = server
    requests = [np.arange(100 * i, 100 * i + n) for i, n in
                enumerate(np.random.default_rng(3).integers(1, 41, 200))]
    calibration = len(logged(log, layout))  # the batches timed before the runner was ready
    answers = send_all(running.url, model, requests)
    for tokens, answer in zip(requests, answers, strict=True):
        assert answer["sum"].tolist() == [[int(tokens.sum())]]
        assert answer["length"].tolist() == [[len(tokens)]]
    batches = logged(log, layout)[calibration:]
    assert sum(batch[0] for batch in batches) == 200
    assert max(batch[0] for batch in batches) > 1
    assert max(batch[0] for batch in batches) <= 8
    assert max(batch[1] for batch in batches) <= 40
    if layout == "ragged":  # ends are the running sum of the lengths, ending at the total
        assert all(batch[-1] == batch[1] and len(batch) == 2 + batch[0] for batch in batches)
        assert any(batch[1] > 1 and batch[0] > 1 for batch in batches)


BAD_INPUTS = {
    "empty": ({"shape": [0], "data": []},
              "input 'tokens' has 0 elements; a ragged input expects a sequence of at least 1"),
    "two dimensions": ({"shape": [1, 3], "data": [1, 2, 3]},
                       "input 'tokens' has shape [1, 3]; expected [-1]"),
    "too long": ({"shape": [41], "data": list(range(41))},
                 "input 'tokens' has 41 elements; model 'sums' takes at most 40 in a batch "
                 "(its max_batch_elements), and a request is never split"),
    "floats": ({"shape": [2], "data": [1.5, 2.0]},
               "input 'tokens' has data that are not all integers; expected INT64 values"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_ragged_inputs_are_400_naming_the_input(
    server: tuple[Server, Path], case: str
) -> None:
    tensor, message = BAD_INPUTS[case]
    request = {"inputs": [{"name": "tokens", "datatype": "INT64", **tensor}]}
    with server[0].client() as client:
        answer = client.post("/v2/models/sums/infer", json=request)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == message


def test_a_sequence_the_model_cannot_run_within_the_limit_even_idle_is_413_in_elements(
    server: tuple[Server, Path],
) -> None:
    """150 elements at 2 ms each need some 300 ms, over max_latency_ms 100: refused at once,
    by the runner's cost model in elements, though 200 would pass max_batch_elements."""
    with server[0].client() as client:
        long = client.post("/v2/models/slow_sums/infer", json=body(np.ones(150, np.int64)))
        short = client.post("/v2/models/slow_sums/infer", json=body(np.ones(5, np.int64)))
    assert long.status_code == 413, long.text
    assert "retry-after" not in long.headers
    error = long.json()["error"]
    match = re.fullmatch(
        r"150 elements need ([\d.]+) ms on runner 'slow_sums' even when it is idle, by its "
        r"current cost model, over its max_latency_ms of 100; send at most (\d+) elements a "
        r"request",
        error,
    )
    assert match is not None, error
    assert float(match[1]) > 100.0 and 0 < int(match[2]) < 150
    assert short.status_code == 200, short.text
    assert short.json()["outputs"][0]["data"] == [5]


def test_metadata_and_the_python_client_treat_a_request_as_one_sequence(
    server: tuple[Server, Path],
) -> None:
    running, _ = server
    with ModelClient(running.url, "text") as client:
        parameters = httpx.get(f"{running.url}/v2/models/text", timeout=10).json()["parameters"]
        assert parameters["variable_length"] == "ragged"
        assert parameters["max_batch_elements"] == 4096
        assert client.metadata().max_batch_size is None  # nothing for the client to cut
        tokens = np.arange(500, 700)  # longer than max_batch_size: still one sequence
        scores = client.infer_batch(tokens=tokens)["scores"]
    np.testing.assert_array_equal(scores, alone(RaggedText(), tokens))


def test_the_readme_examples_run_against_the_bundled_text_model(bundled: Server) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Variable-length inputs (ragged and pad)", 1)[1]
    section = section.split("\n### ", 1)[0]
    request = section.split("```sh\n", 1)[1].split("-d '", 1)[1].split("'\n", 1)[0]
    expected = section.split("```json\n", 1)[1].split("```", 1)[0]
    with bundled.client() as client:
        answer = client.post("/v2/models/text/infer", content=request)
    assert answer.status_code == 200, answer.text
    assert answer.json() == json.loads(expected)
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(code.replace("http://127.0.0.1:3000", bundled.url), {})
