"""Hangs: a model call past its time limit fails its requests and the runner is replaced; a
runner process that stops answering pings is killed and replaced."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.conftest import Server, wait_for

HANG = """
runners:
  hang:
    model: fixture_models:hang_echo
    batch_timeout_ms: 300
    batching: {max_batch_size: 8, max_latency_ms: 2000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""


def infer(server: Server, value: float) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [value] * 4}]}
    with server.client() as client:
        return client.post("/v2/models/hang/infer", json=body)


def serves_again(server: Server, old: list[int]) -> bool:
    runners = server.runners()
    return bool(runners) and not set(runners) & set(old) and infer(server, 1.0).status_code == 200


def test_a_hung_model_call_fails_with_504_and_its_runner_is_replaced(serve: object) -> None:
    server: Server = serve(HANG)  # type: ignore[operator]
    old = server.runners()
    started = time.monotonic()
    answer = infer(server, -1.0)
    assert answer.status_code == 504
    assert answer.json() == {
        "error": "the model did not finish the request's batch within 0.3 s"
    }
    assert time.monotonic() - started < 30  # the 60 s call was not waited for
    wait_for(lambda: serves_again(server, old), 60, "a fresh runner serving")
    assert any("has not come back; exiting to be replaced" in line for line in server.log)


def test_a_runner_that_stops_answering_pings_is_killed_and_replaced(serve: object) -> None:
    server: Server = serve(HANG)  # type: ignore[operator]
    assert infer(server, 1.0).status_code == 200
    old = server.runners()
    os.kill(old[0], signal.SIGSTOP)  # alive, but answers nothing
    wait_for(lambda: serves_again(server, old), 60, "the stopped runner replaced")
    assert any("stopped answering pings; killing it" in line for line in server.log)
