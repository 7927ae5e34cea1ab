"""Graceful drain: SIGTERM to `batchserve serve` stops new work at once, lets the requests
in flight finish within `timeouts.drain_s`, and every process exits 0.

The model holds each request at a gate (a file the test creates), so the requests are
surely in flight when the signal arrives and stay so exactly as long as the test wants.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Server, wait_for

GATED = """
timeouts: {{drain_s: {drain}, kill_after_s: {kill}}}
api: {{workers: 2}}
runners:
  gated:
    model: fixture_models:gated_echo
    batching: {{max_batch_size: 4, max_latency_ms: 30000}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 4]}}]
"""
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [-1, 0, 0, 0]}]}
HELD = 8  # requests in flight when the signal arrives
LATE = 3  # requests sent after it


def infer(server: Server) -> httpx.Response:
    with server.client() as client:  # a new connection each time: either worker may answer
        return client.post("/v2/models/gated/infer", json=BODY)


def get(server: Server, path: str) -> httpx.Response:
    with server.client() as client:
        return client.get(path)


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`, over every process."""
    return sum(
        value.value
        for family in text_string_to_metric_families(text)
        for value in family.samples
        if value.name == name and labels.items() <= value.labels.items()
    )


def in_flight(server: Server) -> float:
    return sample(get(server, "/metrics").text, "batchserve_inflight_requests", runner="gated")


def stopped_with(server: Server, pid: int) -> str | None:
    """The exit status the supervisor logged for child `pid`."""
    marker = f"(pid {pid}) stopped with exit status "
    for line in server.log:
        if marker in line:
            return line.split(marker, 1)[1].strip()
    return None


def assert_every_process_exited_0(server: Server, children: list[int]) -> None:
    assert server.process.wait(30) == 0
    assert server.reader is not None
    server.reader.join(10)  # the whole log has been read
    assert {pid: stopped_with(server, pid) for pid in children} == dict.fromkeys(children, "0")
    stops = [line for line in server.log if "stopped with exit status" in line]
    kinds = ["api" if " api worker " in line else "runner" for line in stops]
    assert kinds == ["api", "api", "runner"], stops  # the API workers before the runner


def test_sigterm_finishes_requests_in_flight_refuses_new_ones_and_exits_0(
    serve: object, tmp_path: Path
) -> None:
    server: Server = serve(GATED.format(drain=30, kill=35))  # type: ignore[operator]
    children = server.children()
    assert len(children) == 3  # two API workers, one runner
    assert get(server, "/v2/health/ready").status_code == 200
    with ThreadPoolExecutor(HELD) as pool:
        held = [pool.submit(infer, server) for _ in range(HELD)]
        wait_for(lambda: in_flight(server) == HELD, 30, "every request in flight")
        server.process.send_signal(signal.SIGTERM)
        wait_for(lambda: get(server, "/v2/health/ready").status_code == 503, 10,
                 "readiness to turn 503")
        late = [infer(server) for _ in range(LATE)]
        model_ready = get(server, "/v2/models/gated/ready")
        metrics = get(server, "/metrics").text
        assert not any(future.done() for future in held)  # all of it while draining
        (tmp_path / "gate").touch()
        answers = [future.result(timeout=30) for future in held]
    assert [answer.status_code for answer in answers] == [200] * HELD
    assert [answer.json()["outputs"][0]["data"] for answer in answers] == [[-1, 0, 0, 0]] * HELD
    assert [answer.status_code for answer in late] == [503] * LATE
    for answer in late:
        assert answer.json() == {"error": "the server is stopping; retry shortly"}
        assert answer.headers["retry-after"] == "1"
        assert answer.headers["connection"] == "close"
    assert model_ready.status_code == 503
    assert sample(metrics, "batchserve_unavailable_total", runner="gated",
                  reason="stopping") == LATE
    assert sample(metrics, "batchserve_requests_total", runner="gated", code="503") == LATE
    assert_every_process_exited_0(server, children)
    with pytest.raises(httpx.ConnectError):  # the port is closed now: refused, not left waiting
        infer(server)


def test_requests_still_held_when_the_grace_period_ends_get_503_and_all_exit_0(
    serve: object, tmp_path: Path
) -> None:
    server: Server = serve(GATED.format(drain=1, kill=3))  # type: ignore[operator]
    children = server.children()
    with ThreadPoolExecutor(HELD) as pool:
        held = [pool.submit(infer, server) for _ in range(HELD)]
        wait_for(lambda: in_flight(server) == HELD, 30, "every request in flight")
        server.process.send_signal(signal.SIGTERM)  # and the gate stays shut: a stuck model
        answers = [future.result(timeout=30) for future in held]
    assert [answer.status_code for answer in answers] == [503] * HELD
    assert {answer.json()["error"] for answer in answers} == {
        "the server stopped before the runner answered; retry shortly"
    }
    assert_every_process_exited_0(server, children)
    assert any("a model call is still running after the drain; exiting without it" in line
               for line in server.log)
    assert any("request(s) unanswered after 1 s; answering 503" in line for line in server.log)
    (tmp_path / "gate").touch()
