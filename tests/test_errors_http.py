"""Bad input gets a clear 4xx naming what is wrong, as do more rows than the latency limit
allows; an SLO that the queue ahead makes unreachable for now gets 503."""

from __future__ import annotations

import re
import socket
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Server, wait_for

SLOW = """
runners:
  slow:
    model: fixture_models:slow_echo
    batching: {{max_batch_size: 4, max_latency_ms: {latency_ms}}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 4]}}]
"""
ROW = {"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}


def test_unknown_model_is_404(bundled: Server) -> None:
    with bundled.client() as client:
        answer = client.post("/v2/models/nope/infer", json={"inputs": [ROW]})
        metadata = client.get("/v2/models/nope")
    assert answer.status_code == 404
    message = ("model 'nope' is not served here; known models: classify, iris_clf, mlp, text, "
               "text_features, tokenize")
    assert answer.json() == {"error": message}
    assert metadata.status_code == 404


def test_wrong_shape_names_the_input_and_the_expectation(bundled: Server) -> None:
    bad = {**ROW, "shape": [1, 255], "data": [0.5] * 255}
    with bundled.client() as client:
        answer = client.post("/v2/models/mlp/infer", json={"inputs": [bad]})
    assert answer.status_code == 400
    assert answer.json()["error"] == "input 'x' has shape [1, 255]; expected [-1, 256]"


def test_malformed_body_is_400_and_the_server_keeps_serving(bundled: Server) -> None:
    with bundled.client() as client:
        broken = client.post("/v2/models/mlp/infer", content=b'{"inputs": [')
        assert broken.status_code == 400
        assert "JSON" in broken.json()["error"]
        header = client.post("/v2/models/mlp/infer", content=b"{}",
                             headers={"Inference-Header-Content-Length": "lots"})
        assert header.status_code == 400
        assert client.post("/v2/models/mlp/infer", json={"inputs": [ROW]}).status_code == 200


def test_a_body_over_the_limit_is_413(serve: object) -> None:
    config = """
api: {max_body_bytes: 2000}
runners:
  echo:
    model: fixture_models:slow_echo
    batching: {max_latency_ms: 2000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""
    server: Server = serve(config)  # type: ignore[operator]
    rows = [[1.0, 2.0, 3.0, 4.0]] * 200
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [200, 4], "data": rows}]}
    with server.client() as client:
        answer = client.post("/v2/models/echo/infer", json=body)
    assert answer.status_code == 413
    assert answer.json()["error"].endswith("exceeds the limit of 2000 bytes")


def test_a_deadline_the_queue_ahead_cannot_meet_is_refused_at_once_with_retry_after(
    serve: object,
) -> None:
    # One 300 ms batch fits the 500 ms limit; a second one behind it cannot.
    server: Server = serve(SLOW.format(latency_ms=500))  # type: ignore[operator]
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}

    def one(_: int) -> httpx.Response:
        with server.client() as client:
            return client.post("/v2/models/slow/infer", json=body)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(4)))
    statuses = [answer.status_code for answer in answers]
    served = statuses.count(200)
    # Requests read together may share the first batch; every other one is refused.
    assert served >= 1 and statuses.count(503) == 4 - served >= 1, statuses
    for answer in answers:
        if answer.status_code != 503:
            continue
        assert answer.headers["retry-after"].isdigit()
        assert answer.json()["error"] in (
            "runner 'slow' refused the request: it cannot be answered within the runner's "
            "latency limit; retry later",
            "runner 'slow' refused the request: its backlog cannot be served within the "
            "request's latency limit; retry later",  # by the API worker, on the same judgement
        )
        assert answer.json()["reason"] in ("queue", "backlog")
    with server.client() as client:
        metrics = client.get("/metrics").text
    # Refused by prediction at arrival: only the first batch ever ran, holding what was served.
    refused = (sample(metrics, "batchserve_rejections_total", runner="slow", reason="queue")
               + sample(metrics, "batchserve_unavailable_total", runner="slow", reason="backlog"))
    assert refused == 4 - served
    assert sample(metrics, "batchserve_adaptive_batch_size_count", runner="slow") == 1
    assert sample(metrics, "batchserve_adaptive_batch_size_sum", runner="slow") == served


def test_an_overloaded_runner_answers_queue_with_a_retry_after_that_grows_with_its_backlog(
    serve: object,
) -> None:
    """Every refusal adds its rows to the backlog its Retry-After covers: behind a 300 ms
    batch of four rows, the first request of four refused is two batches of work (1 s), the
    fifth six (2 s). One API worker: what it refuses in place it counts itself, beside what
    its runner refused."""
    server: Server = serve(SLOW.format(latency_ms=500), "--api-workers", "1")  # type: ignore[operator]
    four = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [4, 4], "data": [1.0] * 16}]}

    def one(_: int) -> httpx.Response:
        with server.client() as client:
            return client.post("/v2/models/slow/infer", json=four)

    with ThreadPoolExecutor(6) as pool:
        refused = [answer for answer in pool.map(one, range(6)) if answer.status_code == 503]
    assert len(refused) >= 3, [answer.text for answer in refused]
    # Refused by the runner, or in place by the API worker on the backlog it published: each
    # refusal's rows count in the backlog all later refusals cover.
    assert {answer.json()["reason"] for answer in refused} <= {"queue", "backlog"}
    retries = sorted(int(answer.headers["retry-after"]) for answer in refused)
    assert retries[0] < retries[-1], retries


def headers_then_body(url: str, body: bytes) -> tuple[bytes, bool]:
    """POST `body` to the slow runner, sending the headers alone first: the answer, and
    whether it came before the body was sent."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
        sock.sendall(b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        sock.settimeout(0.1)
        try:
            answer = sock.recv(65536)
        except TimeoutError:
            answer = b""
        if answer:
            return answer, True
        sock.settimeout(5)
        sock.sendall(body)
        return sock.recv(65536), False


def test_what_the_published_backlog_refuses_is_answered_on_its_headers(
    serve: object,
) -> None:
    """Behind a 300 ms batch a request cannot meet a 500 ms limit: the runner said so as the
    batch started, so the API worker refuses it on its headers, before its body comes."""
    server: Server = serve(SLOW.format(latency_ms=500), "--api-workers", "1")  # type: ignore[operator]
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                     "data": [1, 2, 3, 4]}]})
    with ThreadPoolExecutor(1) as pool, server.client() as client:
        running = pool.submit(client.post, "/v2/models/slow/infer", content=body)
        answers = []
        while not running.done() and len(answers) < 20:
            answers.append(headers_then_body(server.url, body))
        assert running.result().status_code == 200
    early = [answer for answer, before_body in answers if before_body]
    assert early, answers
    for answer in early:
        head, _, content = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert b"retry-after: " in head.lower()
        assert orjson.loads(content)["reason"] == "backlog"


def test_rows_the_model_cannot_run_within_the_limit_even_idle_are_413_at_once(
    bundled: Server,
) -> None:
    rows = 5000
    blob = np.full((rows, 256), 0.5, dtype=np.float32).tobytes()
    header = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 256],
                                        "parameters": {"binary_data_size": len(blob)}}]})
    binary = {"Inference-Header-Content-Length": str(len(header)),
              "Content-Type": "application/octet-stream"}
    with bundled.client() as client:
        answers = [client.post("/v2/models/mlp/infer", content=header + blob, headers=binary)
                   for _ in range(3)]
        metrics = client.get("/metrics").text
    for answer in answers:
        assert answer.status_code == 413, answer.text
        assert "retry-after" not in answer.headers
        error = answer.json()["error"]
        match = re.fullmatch(
            r"5000 rows need ([\d.]+) ms \([\d.]+ ms of it to decode them\) on runner 'mlp' "
            r"even when it is idle, by its current cost model, over its max_latency_ms of 100; "
            r"send at most (\d+) rows a request",
            error,
        )
        assert match is not None, error
        need, most = float(match[1]), int(match[2])
        assert need > 100.0 and 0 < most < rows
    # Refused before any compute: not one batch of 64 rows ran for them.
    assert sample(metrics, "batchserve_adaptive_batch_size_bucket", runner="mlp", le="64.0") \
        == sample(metrics, "batchserve_adaptive_batch_size_bucket", runner="mlp", le="32.0")


NEED = (r"5000 rows need [\d.]+ ms \([\d.]+ ms of it to decode them\) on runner 'mlp' even "
        r"when it is idle, by its current cost model, over its max_latency_ms of 100; send at "
        r"most \d+ rows a request")
DECODE = (r"5000 rows took ([\d.]+) ms of CPU to decode for runner 'mlp', over its "
          r"max_latency_ms of 100 before its model runs; send fewer than about \d+ rows a "
          r"request, or the tensors as binary data \(the binary tensor extension\)")
ARRIVAL = (r"a JSON body of \d+ bytes takes at least ([\d.]+) ms to decode for runner 'mlp' "
           r"\(at the fastest rate this server has decoded its requests\), over its "
           r"max_latency_ms of 100; send fewer rows a request, or the tensors as binary data "
           r"\(the binary tensor extension\), which decode far faster")


def calm(client: httpx.Client) -> None:
    """Wait until the worker serves a row again: a long decode holds its event loop, and
    the front then sheds for a moment (503), which is not what these tests are about."""
    one = {"inputs": [ROW]}
    wait_for(lambda: client.post("/v2/models/mlp/infer", json=one).status_code == 200, 30,
             "the worker to serve again")


def json_rows(rows: int) -> bytes:
    data = np.full((rows, 256), 0.5, dtype=np.float32).ravel().tolist()
    return orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 256],
                                     "data": data}]})


def test_json_rows_too_slow_to_decode_within_the_limit_are_413_at_every_try(
    bundled: Server,
) -> None:
    """5,000 rows of JSON: its decoding and model need more than mlp's 100 ms. The first
    try is refused after decoding (by its CPU time, or by the runner with that time added),
    and once its decoding was seen too slow, on arrival without decoding again."""
    body = json_rows(5000)
    answers = []
    with bundled.client() as client:  # one connection: one API worker
        for _ in range(3):
            calm(client)
            answers.append(client.post("/v2/models/mlp/infer", content=body))
    for answer in answers:
        assert answer.status_code == 413, answer.text
        assert "retry-after" not in answer.headers
    errors = [answer.json()["error"] for answer in answers]
    decoded = re.fullmatch(DECODE, errors[0])
    assert decoded is not None or re.fullmatch(NEED, errors[0]), errors[0]
    if decoded is not None:  # the decoding alone was too slow: known on arrival from now on
        for error in errors[1:]:
            arrival = re.fullmatch(ARRIVAL, error)
            assert arrival is not None and float(arrival[1]) > 100.0, error


def test_a_request_in_pieces_is_never_503_on_an_idle_model(bundled: Server) -> None:
    """1,000 rows binary and 600 rows of JSON are cut into pieces of 64. On an idle model
    each is served, or refused as too large if this machine is too slow for the limit; never
    answered 503, which would have its client retry for ever."""
    blob = np.full((1000, 256), 0.5, dtype=np.float32).tobytes()
    header = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1000, 256],
                                        "parameters": {"binary_data_size": len(blob)}}]})
    binary = {"Inference-Header-Content-Length": str(len(header))}
    with bundled.client() as client:
        for content, headers in [(header + blob, binary), (json_rows(600), {})] * 3:
            calm(client)
            answer = client.post("/v2/models/mlp/infer", content=content, headers=headers)
            assert answer.status_code in (200, 413), answer.text
            if answer.status_code == 413:
                assert "retry-after" not in answer.headers
                assert "even when it is idle" in answer.json()["error"]


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text page, 0 when the series is absent."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and all(found.labels.get(k) == v for k, v in labels.items()):
                return float(found.value)
    return 0.0


def test_a_request_may_shorten_its_own_deadline_with_the_timeout_parameter(
    serve: object,
) -> None:
    server: Server = serve(SLOW.format(latency_ms=5000))  # type: ignore[operator]
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    with server.client() as client:
        relaxed = client.post("/v2/models/slow/infer", json={"inputs": [tensor]})
        hurried = client.post("/v2/models/slow/infer", json={
            "inputs": [tensor], "parameters": {"timeout": 50_000},  # 50 ms, in microseconds
        })
        metrics = client.get("/metrics").text
    assert relaxed.status_code == 200
    # 300 ms of model for a client that allows 50: refused at once, before any compute.
    assert hurried.status_code == 503 and hurried.headers["retry-after"].isdigit()
    assert sample(metrics, "batchserve_rejections_total", runner="slow", reason="queue") == 1
    assert sample(metrics, "batchserve_adaptive_batch_size_count", runner="slow") == 1
