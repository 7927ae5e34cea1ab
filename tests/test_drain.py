"""Graceful drain: SIGTERM to `batchserve serve` stops new work at once, lets the requests
in flight finish within `timeouts.drain_s`, and every process exits 0.

The model holds each request at a gate (a file the test creates), so the requests are
surely in flight when the signal arrives and stay so exactly as long as the test wants.
"""

from __future__ import annotations

import shutil
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, Server, start_server, wait_for
from tests.test_remote import TOKEN, start_runner, stop_runner

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


def in_flight(server: Server, runner: str = "gated") -> float:
    return sample(get(server, "/metrics").text, "batchserve_inflight_requests", runner=runner)


def wait_until_held(server: Server, held: list[Future[httpx.Response]]) -> None:
    """Wait until every request is in flight; one answered already fails at once, naming
    its answer and the server's log, since nothing else would say why it never got held."""
    def all_held() -> bool:
        early = [future.result() for future in held if future.done()]
        assert not early, (
            [(answer.status_code, answer.text) for answer in early], server.log[-30:]
        )
        return in_flight(server) == len(held)

    wait_for(all_held, 30, "every request in flight")


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
        wait_until_held(server, held)
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
        assert answer.json() == {"error": "the server is stopping; retry shortly",
                                 "reason": "draining"}
        assert answer.headers["retry-after"] == "1"
        assert answer.headers["connection"] == "close"
    assert model_ready.status_code == 503
    assert sample(metrics, "batchserve_unavailable_total", runner="gated",
                  reason="draining") == LATE
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
        wait_until_held(server, held)
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



REMOTE = """
timeouts: {{drain_s: 30, kill_after_s: 35}}
transport: {{token_file: token}}
runners:
  gated:
    model: fixture_models:gated_echo
    {addresses}
    batching: {{max_batch_size: 1, max_latency_ms: 30000}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 4]}}]
"""


def test_a_draining_runner_finishes_its_queue_and_its_refusals_go_to_another(
    tmp_path: Path,
) -> None:
    """Two `batchserve runner` processes behind an API-only front, each holding requests at
    the gate; one is sent SIGTERM. It finishes what it holds, and refuses the requests picked
    for it while it drains: each of those runs on the other process instead, so every
    request is answered 200. (Without that second try, about half of the second burst would
    get 503.)"""
    shutil.copy(ROOT / "tests" / "fixture_models.py", tmp_path / "fixture_models.py")
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "runner.yml").write_text(REMOTE.format(addresses=""))
    runners = [start_runner(tmp_path / "runner.yml", "gated", f"tcp:{ip}:0")
               for ip in ("127.0.0.1", "127.0.0.2")]
    draining = runners[0]
    listed = ", ".join(runner.address for runner in runners)
    (tmp_path / "front.yml").write_text(REMOTE.format(addresses=f"addresses: [{listed}]"))
    front = None
    try:
        front = start_server(tmp_path / "front.yml", "--api-only", "--api-workers", "1")
        ready = front
        wait_for(lambda: get(ready, "/v2/health/ready").status_code == 200, 30,
                 "the front to connect to both runners")
        with ThreadPoolExecutor(2 * HELD) as pool:
            first = [pool.submit(infer, front) for _ in range(HELD)]
            wait_for(lambda: in_flight(ready) == HELD, 30, "the first burst at the gate")
            draining.process.send_signal(signal.SIGTERM)
            wait_for(lambda: draining.logged("stopping: draining"), 10, "the drain to start")
            second = [pool.submit(infer, front) for _ in range(HELD)]
            wait_for(lambda: in_flight(ready) == 2 * HELD, 30, "the second burst sent")
            (tmp_path / "gate").touch()
            answers = [future.result(timeout=60) for future in first + second]
        assert [answer.status_code for answer in answers] == [200] * (2 * HELD), [
            answer.text for answer in answers]
        assert draining.process.wait(30) == 0
        assert any("goes to another process" in line for line in front.log), front.log
    finally:
        if front is not None:
            assert front.stop() == 0, "".join(front.log)
        for runner in runners:
            stop_runner(runner)
