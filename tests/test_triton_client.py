"""Every public method of `tritonclient.http.InferenceServerClient` against the real server.

Each method either works, with its result checked, or fails with the protocol's JSON error
and a fitting status, which tritonclient turns into an `InferenceServerException` carrying the
server's own words. The walk is checked to cover every public method of the installed
tritonclient, so a method added to it fails this test until it is walked too. The same routes
are then tried as a curl user would, and every unknown path or method must answer JSON.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from batchserve.runner.core.config import load
from tests.conftest import ROOT, Server, start_server

CONFIG = load(ROOT / "configuration.yml")
MODELS = [*CONFIG.runners, *CONFIG.pipelines]  # every model served, in the index's order
FLOWERS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = start_server(ROOT / "configuration.yml", "--api-workers", "1")
    yield running
    running.stop()


def refused(call: Callable[[], Any], status: int, words: str) -> None:
    """The call fails with the server's JSON error: its status and its message."""
    with pytest.raises(InferenceServerException) as caught:
        call()
    assert caught.value.status() == str(status), caught.value
    assert words in caught.value.message(), caught.value.message()


def flowers(binary: bool) -> list[triton.InferInput]:
    tensor = triton.InferInput("input", list(FLOWERS.shape), "FP32")
    tensor.set_data_from_numpy(FLOWERS, binary_data=binary)
    return [tensor]


def check_scores(result: triton.InferResult) -> None:
    scores = result.as_numpy("scores")
    assert scores.shape == (2, 3)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, rtol=1e-5)
    assert list(scores.argmax(axis=1)) == [0, 2]  # setosa, virginica


def walk_health(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() is True
    assert client.is_server_ready() is True
    assert client.is_model_ready("mlp") is True
    assert client.is_model_ready("mlp", "1") is True
    assert client.is_model_ready("no_such_model") is False


def walk_metadata(client: triton.InferenceServerClient) -> None:
    assert client.get_server_metadata()["name"] == "batchserve"
    metadata = client.get_model_metadata("iris_clf")
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    refused(lambda: client.get_model_metadata("no_such_model"), 404,
            "model 'no_such_model' is not served here")


def walk_config(client: triton.InferenceServerClient) -> None:
    for name, runner in CONFIG.runners.items():
        config = client.get_model_config(name)
        assert config["name"] == name
        assert [item["name"] for item in config["input"]] == [s.name for s in runner.inputs]
        assert [item["name"] for item in config["output"]] == [s.name for s in runner.outputs]
        policy = config["dynamic_batching"]["default_queue_policy"]
        assert policy["default_timeout_microseconds"] == runner.batching.max_latency_ms * 1000
    mlp = client.get_model_config("mlp", "1")
    assert mlp["max_batch_size"] == 64
    assert mlp["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [256]}]
    text = client.get_model_config("text")
    assert text["max_batch_size"] == 0  # a request is one sequence, sent as shape [n]
    assert text["input"][0]["allow_ragged_batch"] is True
    refused(lambda: client.get_model_config("mlp", "2"), 404, "'mlp version 2' is not served")


def walk_repository(client: triton.InferenceServerClient) -> None:
    index = client.get_model_repository_index()
    assert index == [{"name": name, "version": "1", "state": "READY"} for name in MODELS]
    refused(lambda: client.load_model("mlp"), 501, "does not load or unload models")
    refused(lambda: client.unload_model("mlp"), 501, "does not load or unload models")


def walk_infer(client: triton.InferenceServerClient) -> None:
    check_scores(client.infer("iris_clf", flowers(binary=False)))
    binary = client.infer("iris_clf", flowers(binary=True), model_version="1", request_id="7",
                          outputs=[triton.InferRequestedOutput("scores", binary_data=True)])
    assert binary.get_response()["id"] == "7"
    check_scores(binary)
    check_scores(client.async_infer("iris_clf", flowers(binary=True)).get_result())
    refused(lambda: client.infer("iris_clf", flowers(binary=False), model_version="2"), 404,
            "'iris_clf version 2' is not served")


def walk_statistics(client: triton.InferenceServerClient) -> None:
    """After `walk_infer`: three requests answered and one refused for iris_clf."""
    every = client.get_inference_statistics()["model_stats"]
    assert [entry["name"] for entry in every] == MODELS
    stats = client.get_inference_statistics("iris_clf", "1")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 3
    assert stats["inference_stats"]["success"]["ns"] > 0
    assert stats["inference_stats"]["queue"]["count"] == 3
    assert stats["inference_count"] == 6  # rows run
    assert 1 <= stats["execution_count"] <= 3
    refused(lambda: client.get_inference_statistics("no_such_model"), 404, "not served here")


def walk_extensions(client: triton.InferenceServerClient) -> None:
    for status in (client.get_system_shared_memory_status, client.get_cuda_shared_memory_status,
                   client.unregister_system_shared_memory,
                   client.unregister_cuda_shared_memory):
        refused(status, 501, "shared memory")
    refused(lambda: client.register_system_shared_memory("r", "/key", 64), 501, "shared memory")
    refused(lambda: client.register_cuda_shared_memory("r", b"handle", 0, 64), 501,
            "shared memory")
    refused(client.get_log_settings, 501, "log settings")
    refused(lambda: client.update_log_settings({"log_info": True}), 501, "log settings")
    refused(client.get_trace_settings, 501, "tracing")
    refused(lambda: client.get_trace_settings("mlp"), 501, "tracing")
    refused(lambda: client.update_trace_settings("mlp", {"trace_rate": "1"}), 501, "tracing")


class Header:
    """A client plugin: adds one header to every request."""

    def __call__(self, request: Any) -> None:
        request.headers["x-walked"] = "1"


def walk_plugin(client: triton.InferenceServerClient) -> None:
    plugin = Header()
    client.register_plugin(plugin)
    assert client.plugin() is plugin
    assert client.is_server_live()
    client.unregister_plugin()
    assert client.plugin() is None


def walk_bodies(server: Server) -> None:
    """The static helpers: a body tritonclient builds, sent as is; the answer parsed by it."""
    body, header_length = triton.InferenceServerClient.generate_request_body(
        flowers(binary=True), [triton.InferRequestedOutput("scores", binary_data=True)])
    headers = {"Inference-Header-Content-Length": str(header_length)}
    answer = httpx.post(f"{server.url}/v2/models/iris_clf/infer", content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    length = int(answer.headers["inference-header-content-length"])
    check_scores(triton.InferenceServerClient.parse_response_body(answer.content,
                                                                  header_length=length))


WALKED = {
    "is_server_live", "is_server_ready", "is_model_ready", "get_server_metadata",
    "get_model_metadata", "get_model_config", "get_model_repository_index", "load_model",
    "unload_model", "infer", "async_infer", "get_inference_statistics",
    "get_system_shared_memory_status", "get_cuda_shared_memory_status",
    "register_system_shared_memory", "register_cuda_shared_memory",
    "unregister_system_shared_memory", "unregister_cuda_shared_memory", "get_log_settings",
    "update_log_settings", "get_trace_settings", "update_trace_settings", "plugin",
    "register_plugin", "unregister_plugin", "generate_request_body", "parse_response_body",
    "close",
}


def test_the_walk_covers_every_public_method() -> None:
    public = {name for name, _ in inspect.getmembers(triton.InferenceServerClient, callable)
              if not name.startswith("_")}
    assert public == WALKED


def test_every_method_works_or_fails_with_the_servers_json_error(server: Server) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    walk_health(client)
    walk_metadata(client)
    walk_config(client)
    walk_repository(client)
    walk_infer(client)
    walk_statistics(client)
    walk_extensions(client)
    walk_plugin(client)
    walk_bodies(server)
    client.close()


@pytest.mark.parametrize("path", [
    "/v2/models/mlp/config", "/v2/models/mlp/versions/1/config", "/v2/models/stats",
    "/v2/models/mlp/stats", "/v2/models/mlp/versions/1/stats",
])
def test_the_triton_routes_answer_curl_as_json(server: Server, path: str) -> None:
    answer = httpx.get(server.url + path)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()


def test_the_repository_index_takes_a_ready_flag_and_refuses_a_bad_one(server: Server) -> None:
    index = httpx.post(f"{server.url}/v2/repository/index", json={"ready": True})
    assert [entry["name"] for entry in index.json()] == MODELS
    bad = httpx.post(f"{server.url}/v2/repository/index", json={"ready": "yes"})
    assert bad.status_code == 400
    assert bad.json() == {"error": "ready has value \"yes\"; expected true or false"}


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v2/no/such/path"), ("GET", "/v2/models"), ("POST", "/v2/models"),
    ("GET", "/nothing"), ("DELETE", "/v2/models/mlp/config/extra"),
])
def test_an_unknown_path_is_a_json_404_naming_it(server: Server, method: str,
                                                 path: str) -> None:
    answer = httpx.request(method, server.url + path)
    assert answer.status_code == 404
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {"error": f"no route {method} {path}; every route is listed at "
                             "GET /openapi.json (the served models at POST /v2/repository/index)"}


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v2/models/iris_clf/infer", "POST"),
    ("PUT", "/v2/models/iris_clf/versions/1/infer", "POST"),
    ("GET", "/v2/models/no_such_model/infer", "POST"),
    ("POST", "/v2/health/live", "GET, HEAD"),
    ("DELETE", "/v2/models/mlp", "GET, HEAD"),
    ("GET", "/v2/repository/index", "POST"),
])
def test_a_known_path_with_another_method_is_a_json_405_with_allow(
    server: Server, method: str, path: str, allow: str
) -> None:
    answer = httpx.request(method, server.url + path)
    assert answer.status_code == 405
    assert answer.headers["allow"] == allow
    assert answer.json() == {"error": f"{path} does not take {method}; it takes {allow}"}
