"""Pipelines through real processes: a Triton client calls the chain and gets what calling
its steps in turn gives; a saturated later step refuses at the entrance; a failing step ends
the request before the next one runs; a step batching by request parameters gets the
request's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton

from tests.conftest import Server, free_port, wait_for

CHAIN = """
api: {workers: 1, grpc_port: 0}
runners:
  double:
    model: fixture_models:doubled
    batching: {max_batch_size: 16, max_latency_ms: 1000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
  iris_clf:
    model: batchserve.runner.bundled:iris_classifier
    batching: {max_batch_size: 16, max_latency_ms: 1000}
    inputs: [{name: input, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: scores, datatype: FP32, shape: [-1, 3]}]
  nap:
    model: fixture_models:napping_echo
    batching: {max_batch_size: 1, max_latency_ms: 5000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
  poison:
    model: fixture_models:poison_echo
    batching: {max_batch_size: 16, max_latency_ms: 1000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
  scale:
    model: fixture_models:scaled
    batching: {max_batch_size: 16, max_latency_ms: 1000}
    group_by: [factor, shift]
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs:
      - {name: y, datatype: FP32, shape: [-1, 4]}
      - {name: rows, datatype: INT64, shape: [-1, 1]}
pipelines:
  classify:
    max_latency_ms: 1000
    steps:
      - {runner: double}
      - {runner: iris_clf, input_map: {input: y}}
  sleepy:
    max_latency_ms: 150
    steps:
      - {runner: double}
      - {runner: nap, input_map: {x: y}, output_map: {x: z}}
  heavy:
    max_latency_ms: 1000
    steps:
      - {runner: nap, output_map: {x: n}}
      - {runner: double, input_map: {x: n}}
  scaling:
    max_latency_ms: 1000
    steps:
      - {runner: double}
      - {runner: scale, input_map: {x: y}, output_map: {y: scaled, rows: shared}}
    outputs: [scaled]
  fragile:
    max_latency_ms: 1000
    steps:
      - {runner: poison, output_map: {x: p}}
      - {runner: double, input_map: {x: p}}
"""

ROWS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], np.float32) / 2


def infer(client: triton.InferenceServerClient, model: str, name: str, array: np.ndarray,
          output: str) -> np.ndarray:
    tensor = triton.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array, binary_data=True)
    result = client.infer(model, [tensor])
    answer = result.as_numpy(output)
    assert answer is not None
    return answer


def metric(server: Server, name: str, **labels: str) -> float:
    """The sum of a metric's samples carrying `labels`, read from the server's /metrics."""
    total = 0.0
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def chain(serve: Callable[..., Server]) -> Server:
    return serve(CHAIN)


def test_a_triton_client_calls_the_chain_as_the_steps_in_turn(chain: Server) -> None:
    client = triton.InferenceServerClient(chain.url.removeprefix("http://"))
    whole = infer(client, "classify", "x", ROWS, "scores")
    doubled = infer(client, "double", "x", ROWS, "y")
    alone = infer(client, "iris_clf", "input", doubled, "scores")
    assert whole.tobytes() == alone.tobytes()
    assert whole.argmax(axis=1).tolist() == [0, 2]
    config = client.get_model_config("classify")
    assert config["platform"] == "ensemble"
    assert client.get_model_metadata("classify")["platform"] == "ensemble"
    assert client.get_model_metadata("iris_clf")["platform"] == "batchserve"
    assert config["ensemble_scheduling"]["step"] == [
        {"model_name": "double", "model_version": -1, "input_map": {"x": "x"},
         "output_map": {"y": "y"}},
        {"model_name": "iris_clf", "model_version": -1, "input_map": {"input": "y"},
         "output_map": {"scores": "scores"}}]
    metadata = client.get_model_metadata("classify")
    assert [(t["name"], t["datatype"]) for t in metadata["inputs"]] == [("x", "FP32")]
    assert [(t["name"], t["datatype"]) for t in metadata["outputs"]] == [("scores", "FP32")]
    assert client.is_model_ready("classify")
    stats = client.get_inference_statistics("classify")["model_stats"][0]
    assert stats["name"] == "classify" and stats["inference_stats"]["success"]["count"] >= 1


def test_a_saturated_later_step_refuses_at_the_entrance(chain: Server) -> None:
    direct = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                          "data": [1, 2, 3, 4]}]}
    whole = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                         "data": [1, 2, 3, 4]}]}
    with httpx.Client(base_url=chain.url, timeout=30) as http:
        assert http.post("/v2/models/sleepy/infer", json=whole).status_code == 200  # idle: fits
        first = threading.Event()
        answers: list[int] = []

        def call() -> None:
            with httpx.Client(base_url=chain.url, timeout=30) as own:
                answers.append(own.post("/v2/models/nap/infer", json=direct).status_code)
                first.set()

        threads = [threading.Thread(target=call) for _ in range(20)]
        for thread in threads:
            thread.start()
        assert first.wait(30)  # an answer came back with the backlog of the rest
        before = metric(chain, "batchserve_batches_total", runner="double")
        refused = http.post("/v2/models/sleepy/infer", json=whole)
        for thread in threads:
            thread.join()
    assert refused.status_code == 503, refused.text
    body = refused.json()
    assert body["reason"] == "pipeline"
    assert "runner 'nap'" in body["error"] and body["step"] == 1
    assert int(refused.headers["Retry-After"]) >= 1
    assert answers == [200] * 20
    # Refused before any step ran: the first step took no batch for it.
    assert metric(chain, "batchserve_batches_total", runner="double") == before
    assert metric(chain, "batchserve_pipeline_refusals_total", pipeline="sleepy",
                  step="1", runner="nap") == 1


def test_a_failing_step_ends_the_request_before_the_next_runs(chain: Server) -> None:
    poisoned = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                            "data": [666, 1, 2, 3]}]}
    with httpx.Client(base_url=chain.url, timeout=30) as http:
        answer = http.post("/v2/models/fragile/infer", json=poisoned)
    assert answer.status_code == 500, answer.text
    assert answer.json()["error"].startswith("pipeline 'fragile', step 0 (runner 'poison'): ")
    wait_for(lambda: metric(chain, "batchserve_batches_total", runner="poison") >= 1, 10,
             "the poisoned batch counted")
    assert metric(chain, "batchserve_batches_total", runner="double") == 0
    assert metric(chain, "batchserve_requests_total", runner="fragile", code="500") == 1


def test_a_step_that_refuses_ends_the_request_before_the_next_runs(chain: Server) -> None:
    rows = np.ones((200, 4), np.float32)  # 200 naps of 40 ms: past nap's own 5 s limit
    heavy = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [200, 4],
                         "data": rows.ravel().tolist()}]}
    with httpx.Client(base_url=chain.url, timeout=30) as http:
        answer = http.post("/v2/models/heavy/infer", json=heavy)
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"].startswith("pipeline 'heavy', step 0 (runner 'nap'): ")
    assert "200 rows" in answer.json()["error"]
    assert metric(chain, "batchserve_batches_total", runner="double") == 0
    assert metric(chain, "batchserve_requests_total", runner="heavy", code="413") == 1


def test_a_bad_request_names_what_is_wrong(chain: Server) -> None:
    bad: dict[str, Any] = {"inputs": [{"name": "y", "datatype": "FP32", "shape": [1, 4],
                                       "data": [1, 2, 3, 4]}]}
    with httpx.Client(base_url=chain.url, timeout=30) as http:
        answer = http.post("/v2/models/classify/infer", json=bad)
    assert answer.status_code == 400
    assert "input 'y' is not an input of model 'classify'" in answer.json()["error"]


def test_the_grpc_door_serves_the_chain_too(serve: Callable[..., Server]) -> None:
    server = serve(CHAIN, "--grpc-port", str(free_port()))
    client = triton_grpc.InferenceServerClient(server.grpc)
    tensor = triton_grpc.InferInput("x", list(ROWS.shape), "FP32")
    tensor.set_data_from_numpy(ROWS)
    whole = client.infer("classify", [tensor]).as_numpy("scores")
    http = triton.InferenceServerClient(server.url.removeprefix("http://"))
    assert whole.tobytes() == infer(http, "classify", "x", ROWS, "scores").tobytes()
    config = client.get_model_config("classify", as_json=True)["config"]
    assert config["platform"] == "ensemble"
    assert [step["model_name"] for step in config["ensemble_scheduling"]["step"]] == [
        "double", "iris_clf"]
    assert client.is_model_ready("classify")
    assert client.get_model_metadata("classify", as_json=True)["platform"] == "ensemble"
    assert client.get_model_metadata("double", as_json=True)["platform"] == "batchserve"


def test_the_bundled_classify_is_tokenize_then_text(serve: Callable[..., Server]) -> None:
    server = serve()
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    words = np.array([b"the quick brown fox"], dtype=object)
    text = triton.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(words)
    whole = client.infer("classify", [text]).as_numpy("scores")
    tokens = client.infer("tokenize", [text]).as_numpy("tokens")
    assert tokens is not None and tokens.shape == (5,) and tokens[0] == 1
    ids = triton.InferInput("tokens", list(tokens.shape), "INT64")
    ids.set_data_from_numpy(tokens)
    alone = client.infer("text", [ids]).as_numpy("scores")
    assert whole is not None and whole.shape == (1, 4)
    assert whole.tobytes() == alone.tobytes()


def test_a_step_batching_by_parameters_gets_the_requests(chain: Server) -> None:
    def call(parameters: dict[str, Any]) -> httpx.Response:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                            "data": [1, 2, 3, 4]}], "parameters": parameters}
        with httpx.Client(base_url=chain.url, timeout=30) as http:
            return http.post("/v2/models/scaling/infer", json=body)

    for factor, shift in ((3.0, 1), (0.5, 0)):
        answer = call({"factor": factor, "shift": shift})
        assert answer.status_code == 200, answer.text
        (output,) = answer.json()["outputs"]
        assert output["name"] == "scaled"
        assert output["data"] == [2 * x * factor + shift for x in (1, 2, 3, 4)]
    missing = call({"factor": 3.0})
    assert missing.status_code == 400, missing.text
    assert "parameters lack 'shift'" in missing.json()["error"]
