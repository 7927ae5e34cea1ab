"""Every batching feature at once: thousands of concurrent requests with distinct contents to
one real server, each answer checked against its model run alone on that one request.

Rows of different counts (some over the cap, which the server splits), ragged token
sequences, BYTES rows with a per-request separator, and requests grouped by parameters all
share the API workers, the wire and the runners' batches; a mix-up anywhere (a row given to
the wrong request, a piece joined out of order, two groups in one batch) shows as a wrong
answer here.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from batchserve.runner.bundled import mlp, recase
from batchserve.runner.text_model import VOCAB, RaggedText
from tests.conftest import ROOT, Server, start_server

# Keep-alive well past any pause of this client: it encodes and decodes 30 MB of JSON on the
# cores the server uses, and a pooled connection reused just as the server's 5 s keep-alive
# closes it fails the request with a ReadError, the client's race and not the server's.
CONFIG = """
api: {workers: 2}
timeouts: {keep_alive_s: 60}
runners:
  mlp:
    model: batchserve.runner.bundled:mlp
    batching: {max_batch_size: 64, max_latency_ms: 30000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 256]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 16]}]
  text:
    model: batchserve.runner.text_model:RaggedText
    batching: {max_batch_size: 64, max_batch_elements: 4096, max_latency_ms: 30000}
    inputs: [{name: tokens, datatype: INT64, shape: [-1], ragged: true}]
    batch_inputs: [{kind: accumulated_element_count, name: offsets, source: tokens}]
    outputs: [{name: scores, datatype: FP32, shape: [-1, 4]}]
  text_features:
    model: batchserve.runner.bundled:text_features
    batching: {max_batch_size: 16, max_latency_ms: 30000}
    inputs:
      - {name: text, datatype: BYTES, shape: [-1]}
      - {name: separator, datatype: BYTES, shape: [1], batchable: false}
    outputs:
      - {name: features, datatype: FP32, shape: [-1, 4]}
      - {name: normalized, datatype: BYTES, shape: [-1]}
  recase:
    model: batchserve.runner.bundled:recase
    batching: {max_batch_size: 64, max_latency_ms: 30000}
    group_by: {case: upper}
    inputs: [{name: text, datatype: BYTES, shape: [-1]}]
    outputs: [{name: recased, datatype: BYTES, shape: [-1]}]
  scaled:
    model: fixture_models:scaled
    batching: {max_batch_size: 16, max_latency_ms: 30000}
    group_by: [factor, shift]
    inputs: [{name: x, datatype: FP32, shape: [-1, 3]}]
    outputs:
      - {name: y, datatype: FP32, shape: [-1, 3]}
      - {name: rows, datatype: INT64, shape: [-1, 1]}
"""

REQUESTS = 2000
CONNECTIONS = 256
WORDS = ["alpha", "beta", "gamma", "délta", "epsilon", "ζeta", "eta", "theta"]


@dataclass(frozen=True)
class Sent:
    """One request: where it goes, its body, and what its model alone answers to it."""

    model: str
    body: dict[str, Any]
    expected: dict[str, Any]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("mixed")
    (folder / "configuration.yml").write_text(CONFIG)
    shutil.copy(ROOT / "tests" / "fixture_models.py", folder / "fixture_models.py")
    running = start_server(folder / "configuration.yml")
    yield running
    running.stop()


def tensor(name: str, datatype: str, array: np.ndarray) -> dict[str, Any]:
    data = array.reshape(-1).tolist()
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}


def rows_request(rng: np.random.Generator, net: torch.nn.Module) -> Sent:
    count = int(rng.integers(65, 150) if rng.random() < 0.1 else rng.integers(1, 9))  # 65+: split
    x = rng.standard_normal((count, 256)).astype(np.float32)
    with torch.inference_mode():
        y = net(torch.from_numpy(x)).numpy()
    return Sent("mlp", {"inputs": [tensor("x", "FP32", x)]}, {"y": y})


def ragged_request(rng: np.random.Generator, text: RaggedText) -> Sent:
    tokens = rng.integers(0, VOCAB, int(rng.integers(1, 400)))
    with torch.inference_mode():
        scores = text(torch.from_numpy(tokens), torch.tensor([len(tokens)])).numpy()
    return Sent("text", {"inputs": [tensor("tokens", "INT64", tokens)]}, {"scores": scores})


def bytes_request(rng: np.random.Generator) -> Sent:
    separator = ["", "|", ",", " "][int(rng.integers(0, 4))]
    count = int(rng.integers(1, 40))  # past 16: split, each piece with the separator
    lines = [(separator or " ").join(rng.choice(WORDS, int(rng.integers(0, 6))))
             for _ in range(count)]
    features, normalized = [], []
    for line in lines:
        words = [word for word in line.split(separator or None) if word]
        joined = " ".join(words)
        crc = zlib.crc32(joined.encode()) % 1024 / 1024
        features.append((len(line), len(line.encode()), len(words), crc))
        normalized.append(joined)
    body = {"inputs": [tensor("text", "BYTES", np.array(lines, dtype=object)),
                       tensor("separator", "BYTES", np.array([separator], dtype=object))]}
    return Sent("text_features", body, {"features": np.array(features, np.float32),
                                        "normalized": normalized})


def recase_request(rng: np.random.Generator) -> Sent:
    case = ["upper", "lower", "title"][int(rng.integers(0, 3))]
    lines = [" ".join(rng.choice(WORDS, 3)) for _ in range(int(rng.integers(1, 5)))]
    recased = recase(np.array([line.encode() for line in lines], dtype=object), case=case)
    body = {"inputs": [tensor("text", "BYTES", np.array(lines, dtype=object))],
            "parameters": {"case": case}}
    return Sent("recase", body, {"recased": [item.decode() for item in recased]})


def grouped_request(rng: np.random.Generator) -> Sent:
    factor, shift = [(0.5, 0), (2.0, 0), (2.0, 7), (-1.0, 3)][int(rng.integers(0, 4))]
    x = rng.standard_normal((int(rng.integers(1, 40)), 3)).astype(np.float32)
    body = {"inputs": [tensor("x", "FP32", x)], "parameters": {"factor": factor, "shift": shift}}
    return Sent("scaled", body, {"y": (x * factor + shift).astype(np.float32)})


def build(seed: int) -> list[Sent]:
    rng = np.random.default_rng(seed)
    net, text = mlp(), RaggedText()
    makers: list[Callable[[], Sent]] = [
        lambda: rows_request(rng, net), lambda: ragged_request(rng, text),
        lambda: bytes_request(rng), lambda: recase_request(rng), lambda: grouped_request(rng),
    ]
    return [makers[i % len(makers)]() for i in range(REQUESTS)]


def send_all(url: str, sent: list[Sent]) -> list[httpx.Response]:
    """Every request at once, in a shuffled order, over `CONNECTIONS` connections."""
    order = list(range(len(sent)))
    random.Random(3).shuffle(order)

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=CONNECTIONS)
        # As many requests in flight as there are connections: a pool with thousands waiting
        # on it spends the client's core on its own bookkeeping, not on the server.
        free = asyncio.Semaphore(CONNECTIONS)

        async def post(item: Sent) -> httpx.Response:
            async with free:
                return await client.post(f"/v2/models/{item.model}/infer", json=item.body)

        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            answers = await asyncio.gather(*(post(sent[i]) for i in order))
        back: list[httpx.Response] = [answers[0]] * len(sent)
        for position, i in enumerate(order):
            back[i] = answers[position]
        return back

    return asyncio.run(run())


def check(item: Sent, answer: httpx.Response) -> None:
    assert answer.status_code == 200, f"{item.model}: {answer.text}"
    got = {out["name"]: out for out in answer.json()["outputs"]}
    assert set(item.expected) <= set(got), item.model
    for name, expected in item.expected.items():
        data, shape = got[name]["data"], got[name]["shape"]
        if isinstance(expected, list):  # BYTES, as JSON strings
            assert data == expected, (item.model, name)
            continue
        array = np.array(data, np.float32).reshape(shape)
        # The MLP's matrix products may round differently in a batch than alone.
        np.testing.assert_allclose(array, expected, rtol=1e-5, atol=1e-5, err_msg=item.model)


def test_thousands_of_mixed_requests_each_get_their_own_answer(server: Server) -> None:
    sent = build(seed=11)
    answers = send_all(server.url, sent)
    assert len(answers) == REQUESTS
    for item, answer in zip(sent, answers, strict=True):
        check(item, answer)
