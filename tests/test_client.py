"""The Python client end to end: its three front ends against the real server on the bundled
`mlp`, and against a small scripted v2 server for retries, deadlines and errors."""

from __future__ import annotations

import asyncio
import re
import threading
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from batchserve.api import protocol
from batchserve.api.client import (
    AsyncModelClient,
    DeadlineExceeded,
    FuturesModelClient,
    ModelClient,
    ServerError,
    ServerUnavailable,
)
from batchserve.runner.bundled import mlp
from batchserve.runner.core.config import Batching, RunnerConfig, TensorSpec
from batchserve.runner.core.types import Tensors
from tests.conftest import ROOT, Server, wait_for

FRONTS = ["sync", "asyncio", "futures"]


def local_mlp(rows: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return mlp()(torch.from_numpy(rows)).numpy()


def rows(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 256)).astype(np.float32)


def infer(
    front: str, url: str, model: str, *, sample: bool = False, timeout_s: float | None = None,
    options: Mapping[str, Any] | None = None, **inputs: Any,
) -> Tensors:
    """One call through the named front end, with a client of its own."""
    options = options or {}
    if front == "sync":
        with ModelClient(url, model, **options) as client:
            call = client.infer_sample if sample else client.infer_batch
            return call(timeout_s=timeout_s, **inputs)
    if front == "futures":
        with FuturesModelClient(url, model, **options) as futures:
            submit = futures.infer_sample if sample else futures.infer_batch
            future = submit(timeout_s=timeout_s, **inputs)
            assert isinstance(future, Future)
            return future.result()

    async def run() -> Tensors:
        async with AsyncModelClient(url, model, **options) as client:
            call = client.infer_sample if sample else client.infer_batch
            return await call(timeout_s=timeout_s, **inputs)

    return asyncio.run(run())


def answered(server: Server, code: str = "200") -> float:
    """`batchserve_requests_total` for the mlp runner and one status code, over HTTP."""
    with server.client() as client:
        text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "batchserve_requests_total"
                    and sample.labels == {"runner": "mlp", "code": code, "protocol": "http"}):
                return sample.value
    return 0.0


# --- against the real server --------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("front", FRONTS)
def test_each_front_end_answers_as_the_local_model(
    bundled: Server, front: str, binary: bool
) -> None:
    x = rows(5, seed=1)
    outputs = infer(front, bundled.url, "mlp", options={"binary": binary}, x=x)
    assert list(outputs) == ["y"] and outputs["y"].shape == (5, 16)
    np.testing.assert_allclose(outputs["y"], local_mlp(x), atol=1e-5)


@pytest.mark.parametrize("front", FRONTS)
def test_one_sample_goes_without_its_batch_dimension(bundled: Server, front: str) -> None:
    x = rows(1, seed=2)
    outputs = infer(front, bundled.url, "mlp", sample=True, x=x[0])
    assert outputs["y"].shape == (16,)
    np.testing.assert_allclose(outputs["y"], local_mlp(x)[0], atol=1e-5)


def test_the_metadata_tells_the_batch_limit(bundled: Server) -> None:
    with ModelClient(bundled.url, "mlp") as client:
        metadata = client.metadata()
    assert metadata.max_batch_size == 64
    assert [(spec.name, spec.datatype, spec.shape) for spec in metadata.inputs] == [
        ("x", "FP32", (-1, 256))
    ]


@pytest.mark.parametrize("front", FRONTS)
def test_a_batch_over_the_limit_is_split_and_joined_in_order(
    bundled: Server, front: str
) -> None:
    x = rows(4 * 64 + 13, seed=3)  # five chunks: 64, 64, 64, 64, 13
    before = answered(bundled)
    outputs = infer(front, bundled.url, "mlp", x=x)
    np.testing.assert_allclose(outputs["y"], local_mlp(x), atol=1e-5)
    # The counter moves just after each answer is sent, so wait for it to settle.
    wait_for(lambda: answered(bundled) >= before + 5, 10, "five answered requests")
    assert answered(bundled) == before + 5


def test_a_chunking_strategy_of_ones_own(bundled: Server) -> None:
    seen: list[int] = []

    def tens(inputs: Mapping[str, np.ndarray], max_batch_size: int) -> Iterator[Tensors]:
        assert max_batch_size == 64
        x = inputs["x"]
        for start in range(0, len(x), 10):
            seen.append(len(x[start:start + 10]))
            yield {"x": x[start:start + 10]}

    x = rows(95, seed=4)
    before = answered(bundled)
    with ModelClient(bundled.url, "mlp", chunking=tens) as client:
        outputs = client.infer_batch(x)
    assert seen == [10] * 9 + [5]
    np.testing.assert_allclose(outputs["y"], local_mlp(x), atol=1e-5)
    wait_for(lambda: answered(bundled) >= before + 10, 10, "ten answered requests")


def test_the_servers_errors_reach_the_caller(bundled: Server) -> None:
    with ModelClient(bundled.url, "nope") as client, pytest.raises(
        ServerError, match=re.escape(
            "the server answered 404: model 'nope' is not served here; known models: "
            "classify, iris_clf, mlp, text, text_features, tokenize"
        )
    ) as info:
        client.infer_batch(x=rows(1))
    assert info.value.status == 404
    with ModelClient(bundled.url, "mlp") as client, pytest.raises(
        ServerError, match=re.escape(
            "the server answered 400: input 'x' has shape [3, 255]; expected [-1, 256]"
        )
    ) as info:
        client.infer_batch(x=np.zeros((3, 255), np.float32))
    assert info.value.status == 400


def test_inputs_that_are_not_arrays_are_refused_before_sending(bundled: Server) -> None:
    before = answered(bundled, "400")
    with ModelClient(bundled.url, "mlp") as client, pytest.raises(
        ValueError, match=re.escape("input 'x' is a list; expected a numpy array")
    ):
        client.infer_batch(x=rows(2).tolist())
    assert answered(bundled, "400") == before


def test_the_documented_example_runs(bundled: Server) -> None:
    section = (ROOT / "docs" / "client.md").read_text()
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:3000" in code
    exec(code.replace("http://127.0.0.1:3000", bundled.url), {})


def local_text_features(texts: list[bytes], separator: bytes) -> tuple[np.ndarray, list[bytes]]:
    """The bundled `text_features` worked out by hand: characters, bytes, words, hash bucket."""
    features, normalized = [], []
    for raw in texts:
        decoded = raw.decode(errors="replace")
        words = [word for word in decoded.split(separator.decode() or None) if word]
        joined = " ".join(words).encode()
        features.append((len(decoded), len(raw), len(words), (zlib.crc32(joined) % 1024) / 1024))
        normalized.append(joined)
    return np.asarray(features, np.float32), normalized


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("front", FRONTS)
def test_bytes_inputs_and_outputs_and_an_input_without_a_batch_dimension(
    bundled: Server, front: str, binary: bool
) -> None:
    # 150 rows: three chunks of at most 64, each carrying the one separator whole.
    texts = [f"row {i}|é|{'w' * (i % 7)}".encode() for i in range(150)]
    text = np.array(texts, dtype=object)
    outputs = infer(front, bundled.url, "text_features", options={"binary": binary},
                    text=text, separator=np.array(["|"]))
    features, normalized = local_text_features(texts, b"|")
    np.testing.assert_allclose(outputs["features"], features)
    assert outputs["normalized"].dtype == object and list(outputs["normalized"]) == normalized


def test_one_bytes_sample_as_numpy_strings(bundled: Server) -> None:
    with ModelClient(bundled.url, "text_features") as client:
        outputs = client.infer_sample(text=np.array("  two   words "), separator=np.array([b""]))
    assert outputs["normalized"] == b"two words"
    expected, _ = local_text_features([b"  two   words "], b"")
    np.testing.assert_allclose(outputs["features"], expected[0])


def test_bytes_that_json_cannot_carry_are_refused_before_sending(bundled: Server) -> None:
    with ModelClient(bundled.url, "text_features", binary=False) as client, pytest.raises(
        ValueError, match=re.escape("input 'text' holds bytes that are not UTF-8")
    ):
        client.infer_batch(text=np.array([b"\xff"], dtype=object), separator=np.array([""]))
    with ModelClient(bundled.url, "text_features") as client:  # binary carries any bytes
        outputs = client.infer_batch(text=np.array([b"\xff"], dtype=object),
                                     separator=np.array([""]))
    assert list(outputs["normalized"]) == ["\ufffd".encode()]


def test_a_bytes_input_of_numbers_is_refused_by_name(bundled: Server) -> None:
    with ModelClient(bundled.url, "text_features") as client, pytest.raises(
        ValueError, match=re.escape("input 'text' is an array of int64; expected BYTES")
    ):
        client.infer_batch(text=np.arange(3), separator=np.array([""]))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timeout_s": 0}, "timeout_s has value 0; expected seconds > 0"),
        ({"max_workers": 0}, "max_workers has value 0; expected at least 1"),
        ({"max_batch_size": 0}, "max_batch_size has value 0; expected at least 1"),
    ],
)
@pytest.mark.parametrize("client", [ModelClient, AsyncModelClient, FuturesModelClient])
def test_options_out_of_range_are_refused_at_construction(
    client: type, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        client("http://127.0.0.1:9", "mlp", **options)


# --- against a scripted server ------------------------------------------------------------------

ECHO = RunnerConfig(
    name="echo",
    model="models:echo",
    inputs=(TensorSpec("x", "FP32", (-1, 2)), TensorSpec("k", "INT32", (-1,))),
    outputs=(TensorSpec("y", "FP32", (-1, 2)),),
    batching=Batching(max_batch_size=4),
)
HOLD = "hold"
Reply = tuple[int, str | None] | str  # (503, Retry-After or None), or HOLD: answer once released


@dataclass
class Stub:
    """A v2 server for model `echo` (y = x * k): each POST takes the next scripted reply, and
    answers for real when the script is used up."""

    url: str = ""
    script: list[Reply] = field(default_factory=list)
    posts: int = 0
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_reply(self) -> Reply | None:
        with self.lock:
            self.posts += 1
            return self.script.pop(0) if self.script else None


class StubHandler(BaseHTTPRequestHandler):
    server: StubServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.reply(200, protocol.model_metadata(ECHO), {"Content-Type": "application/json"})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        reply = self.server.stub.next_reply()
        if reply == HOLD:
            self.server.stub.release.wait(30)
        elif isinstance(reply, tuple):
            status, retry = reply
            headers = {"Content-Type": "application/json"}
            if retry is not None:
                headers["Retry-After"] = retry
            self.reply(status, b'{"error":"runner busy"}', headers)
            return
        header_length = protocol.parse_header_length(self.headers.get(protocol.HEADER_LENGTH))
        request = protocol.decode_infer(body, header_length, ECHO)
        y = request.inputs["x"] * request.inputs["k"][:, None]
        content, headers = protocol.encode_infer("echo", request, {"y": y}, ECHO)
        self.reply(200, content, headers)

    def reply(self, status: int, content: bytes, headers: Mapping[str, str]) -> None:
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)
        except OSError:  # the client gave up on a held request
            pass


class StubServer(ThreadingHTTPServer):
    stub: Stub


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = StubServer(("127.0.0.1", 0), StubHandler)
    server.stub = Stub(url=f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.stub
    server.stub.release.set()
    server.shutdown()
    server.server_close()
    thread.join()


def echo_inputs(count: int) -> dict[str, np.ndarray]:
    x = np.arange(2 * count, dtype=np.float32).reshape(count, 2)
    return {"x": x, "k": np.arange(count, dtype=np.int32) + 1}


@pytest.mark.parametrize("front", FRONTS)
def test_503_with_retry_after_is_retried_until_answered(stub: Stub, front: str) -> None:
    stub.script = [(503, "0"), (503, "0")]
    inputs = echo_inputs(3)
    outputs = infer(front, stub.url, "echo", timeout_s=10, **inputs)
    np.testing.assert_array_equal(outputs["y"], inputs["x"] * inputs["k"][:, None])
    assert stub.posts == 3


@pytest.mark.parametrize("front", FRONTS)
def test_a_retry_that_would_pass_the_deadline_is_not_made(stub: Stub, front: str) -> None:
    stub.script = [(503, "5")]
    with pytest.raises(ServerUnavailable, match=re.escape(
        "the server answered 503: runner busy (retrying after 5 s would pass the deadline"
    )) as info:
        infer(front, stub.url, "echo", timeout_s=2, **echo_inputs(3))
    assert info.value.retry_after_s == 5.0
    assert stub.posts == 1


@pytest.mark.parametrize("front", FRONTS)
def test_a_503_without_retry_after_is_not_retried(stub: Stub, front: str) -> None:
    stub.script = [(503, None)]
    with pytest.raises(ServerUnavailable, match=re.escape("(no Retry-After: not retried)")):
        infer(front, stub.url, "echo", timeout_s=10, **echo_inputs(3))
    assert stub.posts == 1


@pytest.mark.parametrize("front", FRONTS)
def test_no_answer_by_the_deadline(stub: Stub, front: str) -> None:
    stub.script = [HOLD]
    with pytest.raises(DeadlineExceeded, match="no answer within the call's deadline"):
        infer(front, stub.url, "echo", timeout_s=0.5, **echo_inputs(3))
    assert stub.posts == 1


@pytest.mark.parametrize("front", FRONTS)
def test_chunks_are_joined_in_order(stub: Stub, front: str) -> None:
    inputs = echo_inputs(10)  # chunks of 4, 4 and 2 rows
    outputs = infer(front, stub.url, "echo", **inputs)
    np.testing.assert_array_equal(outputs["y"], inputs["x"] * inputs["k"][:, None])
    assert stub.posts == 3


@pytest.mark.parametrize("front", FRONTS)
def test_one_failed_chunk_fails_the_call(stub: Stub, front: str) -> None:
    stub.script = [(400, None)]
    with pytest.raises(ServerError, match=re.escape("the server answered 400: runner busy")):
        infer(front, stub.url, "echo", options={"max_workers": 1}, **echo_inputs(10))


@pytest.mark.parametrize("front", FRONTS)
def test_inconsistent_first_dimensions_are_refused_before_sending(
    stub: Stub, front: str
) -> None:
    inputs = {"x": np.zeros((3, 2), np.float32), "k": np.ones(2, np.int32)}
    with pytest.raises(ValueError, match=re.escape(
        "input 'k' has 2 rows (dimension 0) but input 'x' has 3; expected the same batch size "
        "for all inputs"
    )):
        infer(front, stub.url, "echo", **inputs)
    assert stub.posts == 0
