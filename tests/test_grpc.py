"""The v2 protocol over gRPC against the real server: every public method of
tritonclient.grpc's client, sync and aio, on every bundled model, answering what HTTP answers;
the error codes; deadlines; health; drain."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
import tritonclient.http as th
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, Server, free_port, start_server
from tests.test_hangs import HANG

MODELS = ("iris_clf", "mlp", "text_features", "text", "tokenize", "classify")
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """The bundled configuration, two API workers sharing one gRPC port."""
    served = start_server(ROOT / "configuration.yml", "--api-workers", "2",
                          "--grpc-port", str(free_port()))
    yield served
    served.stop()


def inputs_for(model: str, module: Any) -> list[Any]:
    """A request for a bundled model, built with tritonclient's `module` (http or grpc)."""
    def tensor(name: str, array: np.ndarray, datatype: str) -> Any:
        item = module.InferInput(name, list(array.shape), datatype)
        if module is th:
            item.set_data_from_numpy(array, binary_data=True)
        else:
            item.set_data_from_numpy(array)
        return item

    if model == "iris_clf":
        return [tensor("input", np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]],
                                         np.float32), "FP32")]
    if model == "mlp":
        return [tensor("x", np.linspace(-1, 1, 3 * 256, dtype=np.float32).reshape(3, 256),
                       "FP32")]
    if model == "text_features":
        text = np.array([b"Hello  world", "naïve café".encode()], dtype=object)
        return [tensor("text", text, "BYTES"),
                tensor("separator", np.array([b""], dtype=object), "BYTES")]
    if model in ("tokenize", "classify"):
        return [tensor("text", np.array([b"the quick brown fox"], dtype=object), "BYTES")]
    return [tensor("tokens", np.array([3, 1, 4, 1, 5, 9], np.int64), "INT64")]


def http_answer(server: Server, model: str) -> dict[str, np.ndarray]:
    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    result = client.infer(model, inputs_for(model, th))
    return {out["name"]: result.as_numpy(out["name"]) for out in result.get_response()["outputs"]}


def same(grpc_result: Any, http: dict[str, np.ndarray]) -> None:
    names = [out.name for out in grpc_result.get_response().outputs]
    assert sorted(names) == sorted(http)
    for name in names:
        got, want = grpc_result.as_numpy(name), http[name]
        if want.dtype == object:
            assert got.tolist() == want.tolist()
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", MODELS)
def test_every_sync_method_on_every_model(server: Server, model: str) -> None:
    client = tg.InferenceServerClient(server.grpc)
    http = th.InferenceServerClient(server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(model) and client.is_model_ready(model, "1")
    assert client.get_server_metadata(as_json=True) == http.get_server_metadata()
    metadata = client.get_model_metadata(model, as_json=True)
    expected = http.get_model_metadata(model)
    for tensor in (*expected["inputs"], *expected["outputs"]):
        tensor.pop("parameters", None)  # v2 gRPC's TensorMetadata has no parameters
    expected.pop("parameters")
    assert {**metadata, "inputs": [{**t, "shape": [int(d) for d in t["shape"]]}
                                   for t in metadata["inputs"]],
            "outputs": [{**t, "shape": [int(d) for d in t["shape"]]}
                        for t in metadata["outputs"]]} == expected
    config = client.get_model_config(model).config
    assert config.name == model
    assert config == json_format.ParseDict(http.get_model_config(model),
                                           model_config_pb2.ModelConfig())
    index = client.get_model_repository_index(as_json=True)["models"]
    assert index == http.get_model_repository_index()
    result = client.infer(model, inputs_for(model, tg), request_id="req-1")
    assert result.get_response().id == "req-1"
    same(result, http_answer(server, model))
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.async_infer(model, inputs_for(model, tg),
                       lambda result, error: done.put((result, error)), request_id="req-2")
    answer, error = done.get(timeout=30)
    assert error is None and answer.get_response().id == "req-2"
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    assert stats["name"] == model and int(stats["inference_stats"]["success"]["count"]) >= 2
    everything = client.get_inference_statistics(as_json=True)["model_stats"]
    assert [entry["name"] for entry in everything] == list(MODELS)
    client.close()


def test_the_stream_answers_each_request_with_its_id_and_errors_without_ending(
        server: Server) -> None:
    client = tg.InferenceServerClient(server.grpc)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(lambda result, error: answers.put((result, error)))
    for index, model in enumerate(MODELS):
        client.async_stream_infer(model, inputs_for(model, tg), request_id=f"s{index}")
    client.async_stream_infer("nope", inputs_for("mlp", tg), request_id="bad")
    client.async_stream_infer("mlp", inputs_for("mlp", tg), request_id="after")
    found, errors = {}, []
    for _ in range(len(MODELS) + 2):
        result, error = answers.get(timeout=30)
        if error is not None:
            errors.append(error.message())
        else:
            found[result.get_response().id] = result
    client.stop_stream()
    assert errors == ["model 'nope' is not served here; known models: classify, iris_clf, mlp, "
                      "text, text_features, tokenize"]
    assert sorted(found) == ["after", "s0", "s1", "s2", "s3", "s4", "s5"]
    for index, model in enumerate(MODELS):
        same(found[f"s{index}"], http_answer(server, model))


def test_the_unsupported_extensions_answer_unimplemented(server: Server) -> None:
    client = tg.InferenceServerClient(server.grpc)
    calls = {
        "load_model": lambda: client.load_model("mlp"),
        "unload_model": lambda: client.unload_model("mlp"),
        "get_system_shared_memory_status": client.get_system_shared_memory_status,
        "register_system_shared_memory": lambda: client.register_system_shared_memory(
            "r", "/k", 8),
        "unregister_system_shared_memory": client.unregister_system_shared_memory,
        "get_cuda_shared_memory_status": client.get_cuda_shared_memory_status,
        "register_cuda_shared_memory": lambda: client.register_cuda_shared_memory(
            "r", b"aGFuZGxl", 0, 8),
        "unregister_cuda_shared_memory": client.unregister_cuda_shared_memory,
        "get_trace_settings": client.get_trace_settings,
        "update_trace_settings": lambda: client.update_trace_settings(settings={"a": "b"}),
        "get_log_settings": client.get_log_settings,
        "update_log_settings": lambda: client.update_log_settings({"log_info": True}),
    }
    for name, call in calls.items():
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert caught.value.status() == "StatusCode.UNIMPLEMENTED", name
        assert caught.value.message().startswith("batchserve does not"), name


def test_every_aio_method_on_every_model(server: Server) -> None:
    async def run() -> None:
        client = tga.InferenceServerClient(server.grpc)
        assert await client.is_server_live() and await client.is_server_ready()
        assert (await client.get_server_metadata(as_json=True))["name"] == "batchserve"
        for model in MODELS:
            assert await client.is_model_ready(model)
            assert (await client.get_model_metadata(model, as_json=True))["name"] == model
            assert (await client.get_model_config(model, as_json=True))["config"]["name"] == model
            result = await client.infer(model, inputs_for(model, tg), request_id=model)
            assert result.get_response().id == model
            same(result, http_answer(server, model))
        index = (await client.get_model_repository_index(as_json=True))["models"]
        assert len(index) == len(MODELS)
        stats = (await client.get_inference_statistics(as_json=True))["model_stats"]
        assert len(stats) == len(MODELS)

        async def requests() -> Any:
            for model in MODELS:
                yield {"model_name": model, "inputs": inputs_for(model, tg),
                       "request_id": f"aio-{model}"}

        seen = set()
        async for result, error in client.stream_infer(requests()):
            assert error is None
            seen.add(result.get_response().id)
            if len(seen) == len(MODELS):
                break
        assert seen == {f"aio-{model}" for model in MODELS}
        with pytest.raises(InferenceServerException, match="UNIMPLEMENTED"):
            await client.load_model("mlp")
        await client.close()

    asyncio.run(run())


def test_typed_contents_in_and_out(server: Server) -> None:
    """Without raw contents, tensors go in `contents` and come back there."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc))
    request = service_pb2.ModelInferRequest(model_name="iris_clf", id="typed")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([5.1, 3.5, 1.4, 0.2])
    answer = stub.ModelInfer(request)
    assert answer.id == "typed" and not answer.raw_output_contents
    (output,) = answer.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("scores", "FP32", [1, 3])
    assert np.argmax(output.contents.fp32_contents) == 0
    text = service_pb2.ModelInferRequest(model_name="text_features")
    text.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        b"a,b,,c")
    text.inputs.add(name="separator", datatype="BYTES",
                    shape=[1]).contents.bytes_contents.append(b",")
    text.outputs.add(name="normalized")
    words = stub.ModelInfer(text).outputs[0].contents.bytes_contents
    assert list(words) == [b"a b c"]


# --- errors ------------------------------------------------------------------------------------


SLOW = """
api: {max_body_bytes: 12000}
runners:
  slow:
    model: fixture_models:slow_echo
    batching: {max_batch_size: 4, max_latency_ms: 1000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""


def _rows(count: int) -> list[Any]:
    item = tg.InferInput("x", [count, 4], "FP32")
    item.set_data_from_numpy(np.ones((count, 4), np.float32))
    return [item]


def _refusal(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_the_error_table_row_by_row(serve: Any) -> None:
    served = serve(SLOW, "--grpc-port", str(free_port()))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(served.grpc))

    def request(model: str, rows: int, shape: list[int] | None = None, **params: int) -> Any:
        message = service_pb2.ModelInferRequest(model_name=model, id="e")
        message.inputs.add(name="x", datatype="FP32", shape=shape or [rows, 4])
        message.raw_input_contents.append(np.ones((rows, 4), np.float32).tobytes())
        for key, value in params.items():
            message.parameters[key].int64_param = value
        return message

    bad = _refusal(lambda: stub.ModelInfer(request("slow", 1, [1, 5])))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.details() == "input 'x' has shape [1, 5]; expected [-1, 4]"
    unknown = _refusal(lambda: stub.ModelInfer(request("nope", 1)))
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert unknown.details() == "model 'nope' is not served here; known models: slow"
    never = _refusal(lambda: stub.ModelInfer(request("slow", 400)))
    assert never.code() == grpc.StatusCode.OUT_OF_RANGE
    with served.client() as http:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [400, 4],
                            "data": [1.0] * 1600}]}
        over_http = http.post("/v2/models/slow/infer", json=body)
    assert over_http.status_code == 413
    assert never.details().split(";")[0] == over_http.json()["error"].split(";")[0]
    too_big = _refusal(lambda: stub.ModelInfer(request("slow", 1000)))
    assert too_big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    unimplemented = _refusal(lambda: stub.RepositoryModelLoad(
        service_pb2.RepositoryModelLoadRequest(model_name="slow")))
    assert unimplemented.code() == grpc.StatusCode.UNIMPLEMENTED
    # A timeout of 1 µs has passed before the request reaches a runner: DEADLINE_EXCEEDED.
    late = _refusal(lambda: stub.ModelInfer(request("slow", 1, timeout=1)))
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert dict(late.trailing_metadata())["batchserve-reason"] == "late"
    # Under load: UNAVAILABLE, with the reason and the retry delay in trailing metadata.
    refusals: list[grpc.RpcError] = []

    def flood() -> None:
        for _ in range(12):
            try:
                stub.ModelInfer(request("slow", 4))
            except grpc.RpcError as exc:
                refusals.append(exc)

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    unavailable = [exc for exc in refusals if exc.code() == grpc.StatusCode.UNAVAILABLE]
    assert unavailable, [exc.code() for exc in refusals]
    trailers = dict(unavailable[0].trailing_metadata())
    assert trailers["batchserve-reason"] in ("queue", "backlog", "front")
    assert int(trailers["retry-after"]) >= 1
    assert "refused" in unavailable[0].details() or "overloaded" in unavailable[0].details()


def test_a_model_call_past_its_time_limit_is_deadline_exceeded(serve: Any) -> None:
    served = serve(HANG, "--grpc-port", str(free_port()))
    client = tg.InferenceServerClient(served.grpc)
    item = tg.InferInput("x", [1, 4], "FP32")
    item.set_data_from_numpy(np.full((1, 4), -1.0, np.float32))  # hang_echo hangs on -1
    with pytest.raises(InferenceServerException) as caught:
        client.infer("hang", [item], client_timeout=30)
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert caught.value.message() == "the model did not finish the request's batch within 0.3 s"


def test_a_grpc_deadline_tighter_than_the_limit_is_the_requests_deadline(serve: Any) -> None:
    """slow_echo takes 300 ms a batch, within the runner's 1000 ms limit: a call whose gRPC
    deadline is 100 ms is refused by the server at once (its trailers say why), not left to
    run out on the client's side."""
    served = serve(SLOW, "--grpc-port", str(free_port()))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(served.grpc))
    message = service_pb2.ModelInferRequest(model_name="slow")
    message.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    message.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    assert len(stub.ModelInfer(message, timeout=5).raw_output_contents) == 1
    started = time.monotonic()
    refused = _refusal(lambda: stub.ModelInfer(message, timeout=0.1))
    assert time.monotonic() - started < 0.09
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(refused.trailing_metadata())["batchserve-reason"] in ("queue", "backlog")


# --- health and drain --------------------------------------------------------------------------


def test_the_standard_health_service(server: Server) -> None:
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.grpc))
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ("", "inference.GRPCInferenceService", *MODELS):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == serving
    missing = _refusal(lambda: health.Check(health_pb2.HealthCheckRequest(service="nope")))
    assert missing.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service="mlp"))
    assert next(watch).status == serving
    watch.cancel()


def test_metrics_count_grpc_under_its_protocol(server: Server) -> None:
    client = tg.InferenceServerClient(server.grpc)
    client.infer("iris_clf", inputs_for("iris_clf", tg))
    with server.client() as http:
        http.post("/v2/models/iris_clf/infer", json={"inputs": [
            {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
        text = http.get("/metrics").text
    for door in ("http", "grpc"):
        assert (f'batchserve_requests_total{{code="200",protocol="{door}",runner="iris_clf"}}'
                in text)


DRAIN = """
runners:
  slow:
    model: fixture_models:slow_echo
    batching: {max_batch_size: 8, max_latency_ms: 2000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
timeouts: {drain_s: 5, kill_after_s: 8}
"""


def test_drain_under_load_loses_no_call(serve: Any) -> None:
    """SIGTERM while calls are in flight: each is answered (none cut off), the server exits
    0, and new calls are refused rather than left hanging."""
    served = serve(DRAIN, "--grpc-port", str(free_port()), "--api-workers", "2")
    client = tg.InferenceServerClient(served.grpc)
    outcomes: list[str] = []
    started = threading.Event()

    def call() -> None:
        started.set()
        try:
            client.infer("slow", _rows(1), client_timeout=10)
            outcomes.append("ok")
        except InferenceServerException as exc:
            outcomes.append(str(exc.status()))

    threads = [threading.Thread(target=call) for _ in range(16)]
    for thread in threads:
        thread.start()
    started.wait(5)
    time.sleep(0.05)  # let the calls reach the workers; what comes later is refused, not lost
    assert served.stop(timeout=20) == 0
    for thread in threads:
        thread.join(15)
    assert len(outcomes) == 16
    assert outcomes.count("ok") >= 1
    assert set(outcomes) <= {"ok", "StatusCode.UNAVAILABLE"}, outcomes
