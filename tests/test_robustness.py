"""Under overload, faults and garbage, every request gets exactly one answer."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx

from batchserve.api.bench.loadgen import run_load
from tests.conftest import Server, cmdline, wait_for

BUSY = """
api: {workers: 2}
runners:
  busy:
    model: fixture_models:busy_echo
    batching: {max_batch_size: 4, max_latency_ms: 50}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""


def test_overload_answers_every_request_with_200_or_503(serve: object) -> None:
    server: Server = serve(BUSY)  # type: ignore[operator]
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                   "data": [1, 2, 3, 4]}]}).encode()
    # About 800 rows a second fit (4 rows per 5 ms); offer three times that for 2 s.
    result = asyncio.run(run_load(f"{server.url}/v2/models/busy/infer", body,
                                  {"Content-Type": "application/json"}, rate=2400, seconds=2))
    assert result.sent > 4000
    assert result.answered == result.sent  # no timeouts, no broken connections
    assert set(result.error_fraction) == {"503"}, result.error_fraction
    assert 0 < result.ok < result.sent
    with server.client() as client:  # and it serves normally right after
        assert client.post("/v2/models/busy/infer", content=body).status_code == 200


def test_a_killed_api_worker_is_replaced_while_the_other_keeps_serving(serve: object) -> None:
    server: Server = serve(BUSY)  # type: ignore[operator]
    workers = [pid for pid in server.children() if b"\0-m\0batchserve.api.worker\0" in cmdline(pid)]
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    for _ in range(20):  # the surviving worker answers; the port never closes
        with server.client() as client:
            answer = client.post("/v2/models/busy/infer", json=body)
            assert answer.status_code == 200, answer.text

    def replaced() -> bool:
        now = [pid for pid in server.children() if b"\0-m\0batchserve.api.worker\0" in cmdline(pid)]
        return len(now) == 2 and workers[0] not in now

    wait_for(replaced, 60, "a replacement API worker")


def mutations(rng: random.Random, valid: bytes) -> list[bytes]:
    """Random bytes, truncations, byte flips and wrong JSON shapes of a valid body."""
    out = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 300))) for _ in range(60)]
    out += [valid[: rng.randrange(len(valid))] for _ in range(60)]
    for _ in range(60):
        flipped = bytearray(valid)
        for _ in range(rng.randrange(1, 6)):
            flipped[rng.randrange(len(flipped))] = rng.getrandbits(8)
        out.append(bytes(flipped))
    shapes = [{}, [], {"inputs": None}, {"inputs": [None]}, {"inputs": [{"name": "x"}]},
              {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": "a"}]},
              {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 256], "data": []}]},
              {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256],
                           "data": [[1e39] * 256]}]},
              {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1, 256], "data": [1] * 256}]},
              {"outputs": [{"name": "nope"}], "inputs": []}]
    return out + [json.dumps(shape).encode() for shape in shapes]


def test_garbage_bodies_get_a_4xx_naming_the_problem_and_never_a_5xx(bundled: Server) -> None:
    valid = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256],
                                    "data": [0.5] * 256}]}).encode()
    with httpx.Client(base_url=bundled.url, timeout=30) as client:
        for body in mutations(random.Random(5), valid):
            answer = client.post("/v2/models/mlp/infer", content=body)
            if answer.status_code == 200:  # a flip inside a number can leave it valid
                continue
            assert 400 <= answer.status_code < 500, (body[:80], answer.text)
            assert answer.json()["error"], body[:80]
            binary = client.post("/v2/models/mlp/infer", content=body,
                                 headers={"Inference-Header-Content-Length": str(len(body) // 2)})
            assert 400 <= binary.status_code < 500 or binary.status_code == 200, binary.text
        assert client.post("/v2/models/mlp/infer", content=valid).status_code == 200


POISON = """
runners:
  poison:
    model: fixture_models:poison_echo
    batching: {max_batch_size: 32, max_latency_ms: 2000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""


def test_a_poison_request_fails_alone_with_a_500_naming_the_models_error(serve: object) -> None:
    server: Server = serve(POISON)  # type: ignore[operator]

    def one(i: int) -> httpx.Response:
        value = 666.0 if i == 7 else float(i)
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                            "data": [value] * 4}]}
        with server.client() as client:
            return client.post("/v2/models/poison/infer", json=body)

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(one, range(20)))
    codes = [answer.status_code for answer in answers]
    assert codes == [500 if i == 7 else 200 for i in range(20)], codes
    assert answers[7].json() == {"error": "the model failed: ValueError: 666 is poison"}
    for i, answer in enumerate(answers):
        if i != 7:
            assert answer.json()["outputs"][0]["data"] == [float(i)] * 4
    assert one(3).status_code == 200  # and the runner serves on
