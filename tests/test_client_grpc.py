"""The Python client over gRPC (`grpc://HOST:PORT`): its three front ends against the real
server's gRPC door on every bundled model, answering what the HTTP transport answers with the
same errors; and against a small scripted gRPC server for retries, deadlines and chunks."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import json_format

from batchserve.api import protocol, triton
from batchserve.api.client import ModelClient, ServerError, ServerUnavailable
from batchserve.api.client.codec import DeadlineExceeded
from batchserve.api.client.grpc_codec import check_status
from batchserve.api.grpc import codec as door_codec
from batchserve.api.grpc.messages import SERVICE, message
from tests.conftest import ROOT, Server, free_port, start_server
from tests.test_client import (
    ECHO,
    FRONTS,
    HOLD,
    echo_inputs,
    infer,
    local_mlp,
    local_text_features,
    rows,
)

MODELS = ("iris_clf", "mlp", "text_features", "text")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    served = start_server(ROOT / "configuration.yml", "--api-workers", "2",
                          "--grpc-port", str(free_port()))
    yield served
    served.stop()


def grpc_url(server: Server) -> str:
    return f"grpc://{server.grpc}"


def inputs_for(model: str) -> dict[str, np.ndarray]:
    if model == "iris_clf":
        return {"input": np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], np.float32)}
    if model == "mlp":
        return {"x": rows(3, seed=5)}
    if model == "text_features":
        return {"text": np.array(["Hello  world", "naïve café"], dtype=object),
                "separator": np.array([""])}
    return {"tokens": np.array([3, 1, 4, 1, 5, 9], np.int64)}


# --- against the real server --------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("front", FRONTS)
def test_each_front_end_answers_as_the_local_model(
    server: Server, front: str, binary: bool
) -> None:
    x = rows(4 * 64 + 13, seed=3)  # five chunks: 64, 64, 64, 64, 13
    outputs = infer(front, grpc_url(server), "mlp", options={"binary": binary}, x=x)
    assert list(outputs) == ["y"] and outputs["y"].shape == (len(x), 16)
    np.testing.assert_allclose(outputs["y"], local_mlp(x), atol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_every_bundled_model_answers_as_over_http(server: Server, model: str) -> None:
    with ModelClient(server.url, model) as http, ModelClient(grpc_url(server), model) as rpc:
        over_http = http.infer_batch(**inputs_for(model))
        over_grpc = rpc.infer_batch(**inputs_for(model))
        assert rpc.metadata().inputs == http.metadata().inputs
        assert rpc.metadata().outputs == http.metadata().outputs
    assert list(over_grpc) == list(over_http)
    for name, array in over_http.items():
        assert over_grpc[name].dtype == array.dtype and over_grpc[name].shape == array.shape
        if array.dtype == object:
            assert over_grpc[name].tolist() == array.tolist()
        else:
            np.testing.assert_allclose(over_grpc[name], array, rtol=1e-6)


def test_the_metadata_tells_the_batch_limit_from_the_model_configuration(
    server: Server
) -> None:
    with ModelClient(grpc_url(server), "mlp") as client:
        metadata = client.metadata()
    assert metadata.max_batch_size == 64
    assert [(spec.name, spec.datatype, spec.shape) for spec in metadata.inputs] == [
        ("x", "FP32", (-1, 256))
    ]
    with ModelClient(grpc_url(server), "text_features") as client:
        assert client.metadata().unbatched == {"separator"}


@pytest.mark.parametrize("front", FRONTS)
def test_bytes_and_an_input_without_a_batch_dimension(server: Server, front: str) -> None:
    texts = [f"row {i}|é|{'w' * (i % 7)}".encode() for i in range(150)]
    outputs = infer(front, grpc_url(server), "text_features",
                    text=np.array(texts, dtype=object), separator=np.array(["|"]))
    features, normalized = local_text_features(texts, b"|")
    np.testing.assert_allclose(outputs["features"], features)
    assert outputs["normalized"].dtype == object and list(outputs["normalized"]) == normalized


def test_one_sample_goes_without_its_batch_dimension(server: Server) -> None:
    x = rows(1, seed=2)
    with ModelClient(grpc_url(server), "mlp") as client:
        outputs = client.infer_sample(x[0])
    np.testing.assert_allclose(outputs["y"], local_mlp(x)[0], atol=1e-5)


def test_the_servers_errors_are_those_of_http_with_the_same_words(server: Server) -> None:
    for url in (server.url, grpc_url(server)):
        with ModelClient(url, "nope") as client, pytest.raises(ServerError, match=re.escape(
            "the server answered 404: model 'nope' is not served here; known models: "
            "classify, iris_clf, mlp, text, text_features, tokenize"
        )) as info:
            client.infer_batch(x=rows(1))
        assert info.value.status == 404
        with ModelClient(url, "mlp") as client, pytest.raises(ServerError, match=re.escape(
            "the server answered 400: input 'x' has shape [3, 255]; expected [-1, 256]"
        )) as info:
            client.infer_batch(x=np.zeros((3, 255), np.float32))
        assert info.value.status == 400


def test_the_documented_example_runs(server: Server) -> None:
    section = (ROOT / "docs" / "client.md").read_text().split("## Over gRPC", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "grpc://127.0.0.1:8001" in code
    exec(code.replace("grpc://127.0.0.1:8001", grpc_url(server)), {})


def test_a_refused_connection_is_unavailable_without_a_reason() -> None:
    with ModelClient(f"grpc://127.0.0.1:{free_port()}", "mlp", timeout_s=2) as client, \
            pytest.raises(ServerUnavailable) as info:
        client.infer_batch(x=rows(1))
    assert info.value.status == 503 and info.value.reason is None


# --- the status codes, pure ---------------------------------------------------------------------


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.OUT_OF_RANGE, 413), (grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
    (grpc.StatusCode.UNIMPLEMENTED, 501), (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.UNKNOWN, 500),
])
def test_each_code_is_the_http_status_of_its_decision(code: grpc.StatusCode, status: int
                                                      ) -> None:
    with pytest.raises(ServerError) as info:
        check_status(code, "why", (), 10.0)
    assert (type(info.value), info.value.status, str(info.value)) == (
        ServerError, status, f"the server answered {status}: why")


def test_a_refusal_reads_its_reason_and_delay_from_the_trailers() -> None:
    trailers = (("retry-after", "2"), ("batchserve-reason", "queue"))
    assert check_status(grpc.StatusCode.UNAVAILABLE, "busy", trailers, 10.0) == 2.0
    with pytest.raises(ServerUnavailable, match=re.escape(
            "the server answered 503: busy (retrying after 2 s would pass the deadline")) as info:
        check_status(grpc.StatusCode.UNAVAILABLE, "busy", trailers, 1.0)
    assert (info.value.reason, info.value.retry_after_s) == ("queue", 2.0)
    # An expired request is the 503 it is over HTTP, retried as one.
    late = (("retry-after", "1"), ("batchserve-reason", "late"))
    assert check_status(grpc.StatusCode.DEADLINE_EXCEEDED, "late", late, 10.0) == 1.0


# --- against a scripted server ------------------------------------------------------------------


@dataclass
class Stub:
    """A gRPC v2 server for model `echo` (y = x * k): each ModelInfer takes the next scripted
    reply, (code, retry-after or None) or HOLD, and answers for real when the script is used
    up."""

    url: str = ""
    script: list[Any] = field(default_factory=list)
    calls: int = 0
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_reply(self) -> Any:
        with self.lock:
            self.calls += 1
            return self.script.pop(0) if self.script else None

    def infer(self, body: bytes, context: grpc.ServicerContext) -> bytes:
        reply = self.next_reply()
        if reply == HOLD:
            self.release.wait(30)
        elif reply is not None:
            code, retry = reply
            trailers = (("batchserve-reason", "queue"),)
            if retry is not None:
                trailers += (("retry-after", retry),)
            context.set_trailing_metadata(trailers)
            context.abort(code, "runner busy")
        request = door_codec.decode_infer(door_codec.read_request(body), ECHO, None)
        y = request.inputs["x"] * request.inputs["k"][:, None]
        return door_codec.encode_infer(ECHO, request, {"y": y})


def _described(request: Any, context: Any) -> Any:
    return json_format.Parse(protocol.model_metadata(ECHO), message("ModelMetadataResponse")(),
                             ignore_unknown_fields=True)


def _config(request: Any, context: Any) -> Any:
    answer = message("ModelConfigResponse")()
    json_format.ParseDict(triton.config_document(ECHO), answer.config)
    return answer


@pytest.fixture
def stub() -> Iterator[Stub]:
    found = Stub()
    serialize = message("ModelMetadataRequest").FromString
    handlers = {
        "ModelMetadata": grpc.unary_unary_rpc_method_handler(
            _described, serialize, lambda m: m.SerializeToString()),
        "ModelConfig": grpc.unary_unary_rpc_method_handler(
            _config, message("ModelConfigRequest").FromString, lambda m: m.SerializeToString()),
        "ModelInfer": grpc.unary_unary_rpc_method_handler(found.infer),
    }
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    found.url = f"grpc://127.0.0.1:{port}"
    yield found
    found.release.set()
    server.stop(0).wait()


@pytest.mark.parametrize("front", FRONTS)
def test_unavailable_with_retry_after_is_retried_until_answered(stub: Stub, front: str) -> None:
    stub.script = [(grpc.StatusCode.UNAVAILABLE, "0"), (grpc.StatusCode.UNAVAILABLE, "0")]
    inputs = echo_inputs(3)
    outputs = infer(front, stub.url, "echo", timeout_s=10, **inputs)
    np.testing.assert_array_equal(outputs["y"], inputs["x"] * inputs["k"][:, None])
    assert stub.calls == 3


@pytest.mark.parametrize("front", FRONTS)
def test_a_retry_that_would_pass_the_deadline_is_not_made(stub: Stub, front: str) -> None:
    stub.script = [(grpc.StatusCode.UNAVAILABLE, "5")]
    with pytest.raises(ServerUnavailable, match=re.escape(
        "the server answered 503: runner busy (retrying after 5 s would pass the deadline"
    )) as info:
        infer(front, stub.url, "echo", timeout_s=2, **echo_inputs(3))
    assert (info.value.retry_after_s, info.value.reason) == (5.0, "queue")
    assert stub.calls == 1


@pytest.mark.parametrize("front", FRONTS)
def test_unavailable_without_retry_after_is_not_retried(stub: Stub, front: str) -> None:
    stub.script = [(grpc.StatusCode.UNAVAILABLE, None)]
    with pytest.raises(ServerUnavailable, match=re.escape("(no Retry-After: not retried)")):
        infer(front, stub.url, "echo", timeout_s=10, **echo_inputs(3))
    assert stub.calls == 1


@pytest.mark.parametrize("front", FRONTS)
def test_no_answer_by_the_deadline(stub: Stub, front: str) -> None:
    stub.script = [HOLD]
    with pytest.raises(DeadlineExceeded, match="no answer within the call's deadline"):
        infer(front, stub.url, "echo", timeout_s=0.5, **echo_inputs(3))
    assert stub.calls == 1


@pytest.mark.parametrize("front", FRONTS)
def test_chunks_are_joined_in_order(stub: Stub, front: str) -> None:
    inputs = echo_inputs(10)  # chunks of 4, 4 and 2 rows
    outputs = infer(front, stub.url, "echo", **inputs)
    np.testing.assert_array_equal(outputs["y"], inputs["x"] * inputs["k"][:, None])
    assert stub.calls == 3
