"""BYTES tensors and non-batchable inputs, end to end through a real server.

The bundled `text_features` takes UTF-8 text (BYTES rows) and a non-batchable `separator`;
these tests send it BYTES in JSON, in binary bodies built by hand (a 4-byte little-endian
length before each element) and through tritonclient, and read BYTES outputs back. A fixture
model that reports its own batch shows a non-batchable input reaching the model as one item
per request while concurrent requests batch together.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from tests.conftest import Server

TEXTS = ["Hello  world", "naïve café au lait", "", "one"]


def prefixed(*items: bytes) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def expected_features(texts: list[str], separator: str | None = None) -> list[list[float]]:
    rows = []
    for text in texts:
        words = [word for word in text.split(separator) if word]
        rows.append([len(text), len(text.encode()), len(words)])
    return rows


def test_bytes_in_json_and_bytes_outputs_as_strings(bundled: Server) -> None:
    body = {"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [4], "data": TEXTS},
        {"name": "separator", "datatype": "BYTES", "shape": [1], "data": [""]},
    ]}
    with bundled.client() as client:
        answer = client.post("/v2/models/text_features/infer", json=body)
    assert answer.status_code == 200, answer.text
    outputs = {item["name"]: item for item in answer.json()["outputs"]}
    assert outputs["normalized"] == {"name": "normalized", "datatype": "BYTES", "shape": [4],
                                     "data": ["Hello world", "naïve café au lait", "", "one"]}
    features = np.array(outputs["features"]["data"]).reshape(4, 4)
    assert features[:, :3].tolist() == expected_features(TEXTS)


def test_bytes_in_a_binary_body_built_by_hand(bundled: Server) -> None:
    text = prefixed(b"a,b,,c", "ü,ß".encode(), b"\xff,x")  # the last is not UTF-8
    separator = prefixed(b",")
    header = orjson.dumps({
        "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [3],
             "parameters": {"binary_data_size": len(text)}},
            {"name": "separator", "datatype": "BYTES", "shape": [1],
             "parameters": {"binary_data_size": len(separator)}},
        ],
        "outputs": [{"name": "normalized", "parameters": {"binary_data": True}}],
    })
    with bundled.client() as client:
        answer = client.post(
            "/v2/models/text_features/infer", content=header + text + separator,
            headers={"Content-Type": "application/octet-stream",
                     "Inference-Header-Content-Length": str(len(header))})
    assert answer.status_code == 200, answer.text
    length = int(answer.headers["Inference-Header-Content-Length"])
    document = orjson.loads(answer.content[:length])
    expected = prefixed(b"a b c", "ü ß".encode(), "\ufffd x".encode())
    assert document["outputs"][0]["parameters"] == {"binary_data_size": len(expected)}
    assert answer.content[length:] == expected


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_sends_and_reads_bytes(bundled: Server, binary: bool) -> None:
    client = triton.InferenceServerClient(bundled.url.removeprefix("http://"))
    text = triton.InferInput("text", [4], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object),
                             binary_data=binary)
    separator = triton.InferInput("separator", [1], "BYTES")
    separator.set_data_from_numpy(np.array([b" "], dtype=object), binary_data=binary)
    outputs = [triton.InferRequestedOutput(name, binary_data=binary)
               for name in ("normalized", "features")]
    result = client.infer("text_features", [text, separator], outputs=outputs)
    normalized = result.as_numpy("normalized")
    assert normalized.dtype == object and normalized.shape == (4,)
    expected = ["Hello world", "naïve café au lait", "", "one"]
    # tritonclient reads binary BYTES as bytes and JSON BYTES as str
    assert normalized.tolist() == ([e.encode() for e in expected] if binary else expected)
    assert result.as_numpy("features")[:, :3].tolist() == expected_features(TEXTS, " ")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (prefixed(b"ab") + b"\x05\x00",
         "input 'text' has BYTES binary data that end inside the length of element 1"),
        (prefixed(b"ab") + (1000).to_bytes(4, "little") + b"xy",
         "input 'text' has BYTES element 1 of 1000 bytes, past the end of its binary data"),
    ],
    ids=["truncated-length", "length-past-end"],
)
def test_malformed_binary_bytes_are_400_naming_the_input(
    bundled: Server, text: bytes, message: str
) -> None:
    separator = prefixed(b"")
    header = orjson.dumps({"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [2],
         "parameters": {"binary_data_size": len(text)}},
        {"name": "separator", "datatype": "BYTES", "shape": [1],
         "parameters": {"binary_data_size": len(separator)}},
    ]})
    with bundled.client() as client:
        answer = client.post(
            "/v2/models/text_features/infer", content=header + text + separator,
            headers={"Inference-Header-Content-Length": str(len(header))})
        assert answer.status_code == 400
        assert answer.json()["error"].startswith(message)
        assert client.get("/v2/health/ready").status_code == 200  # and it keeps serving


def test_metadata_and_openapi_describe_bytes_and_non_batchable_inputs(bundled: Server) -> None:
    with bundled.client() as client:
        metadata = client.get("/v2/models/text_features").json()
        described = client.get("/openapi.json").json()
    assert metadata["inputs"] == [
        {"name": "text", "datatype": "BYTES", "shape": [-1]},
        {"name": "separator", "datatype": "BYTES", "shape": [1],
         "parameters": {"batchable": False}},
    ]
    schema = described["paths"]["/v2/models/text_features/infer"]["post"]["requestBody"]
    text, separator = schema["content"]["application/json"]["schema"]["properties"][
        "inputs"]["items"]["anyOf"]
    assert text["properties"]["datatype"]["enum"] == ["BYTES"]
    assert {"type": "string"} in text["properties"]["data"]["items"]["anyOf"]
    assert "not batchable" in separator["properties"]["shape"]["description"]


TAGGED = """
runners:
  tagged:
    model: fixture_models:tagged_batch
    batching: {max_batch_size: 32, max_latency_ms: 3000}
    inputs:
      - {name: text, datatype: BYTES, shape: [-1]}
      - {name: tag, datatype: BYTES, shape: [1], batchable: false}
    outputs:
      - {name: tag, datatype: BYTES, shape: [-1]}
      - {name: requests, datatype: INT64, shape: [-1]}
      - {name: echo, datatype: BYTES, shape: [-1]}
"""


def test_a_non_batchable_input_reaches_the_model_once_per_request_in_shared_batches(
    serve: Any,
) -> None:
    server = serve(TAGGED)
    count = 24
    start = threading.Barrier(count)

    def one(i: int) -> dict[str, Any]:
        rows = 1 + i % 3  # requests of 1, 2 and 3 rows
        body = {"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [rows],
             "data": [f"r{i}-{j}" for j in range(rows)]},
            {"name": "tag", "datatype": "BYTES", "shape": [1], "data": [f"tag-{i}"]},
        ]}
        with server.client() as client:
            start.wait()
            answer = client.post("/v2/models/tagged/infer", json=body)
        assert answer.status_code == 200, answer.text
        return {item["name"]: item["data"] for item in answer.json()["outputs"]}

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(one, range(count)))
    for i, outputs in enumerate(answers):
        rows = 1 + i % 3
        assert outputs["tag"] == [f"tag-{i}"] * rows  # its own item, on each of its rows
        assert outputs["echo"] == [f"r{i}-{j}" for j in range(rows)]
    sharing = [outputs["requests"][0] for outputs in answers]
    assert max(sharing) > 1, f"no batch held more than one request: {sharing}"
