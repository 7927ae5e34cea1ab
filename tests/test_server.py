"""End to end: the real `batchserve serve`, real processes, real sockets, real clients."""

from __future__ import annotations

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families

from batchserve.runner.bundled import iris_classifier, mlp
from tests.conftest import Server, wait_for

PID_CONFIG = """
api: {{workers: 2}}
runners:
  {name}:
    model: fixture_models:{model}
    workers: 2
    batching: {{max_batch_size: 8, max_latency_ms: {latency}}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{outputs}]
"""
PID_OUTPUTS = (
    "{name: echo, datatype: FP32, shape: [-1, 4]}, {name: pid, datatype: INT64, shape: [-1, 1]}"
)


def mlp_reference(rows: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return mlp()(torch.from_numpy(rows)).numpy()


def histogram(metrics_text: str, name: str, **labels: str) -> dict[str, float]:
    """The samples of one histogram's series, keyed by suffix and bucket bound."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                suffix = sample.name[len(name):]
                key = f"{suffix}:{sample.labels['le']}" if "le" in sample.labels else suffix
                found[key] = sample.value
    return found


def test_iris_scores_as_the_readme_shows(bundled: Server) -> None:
    rows = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 4], "data": rows}]}
    with bundled.client() as client:
        answer = client.post("/v2/models/iris_clf/infer", json=body)
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    assert output["name"] == "scores" and output["shape"] == [2, 3]
    expected = iris_classifier()(np.array(rows, dtype=np.float32))
    np.testing.assert_allclose(np.array(output["data"]).reshape(2, 3), expected, rtol=1e-6)
    assert np.argmax(expected, axis=1).tolist() == [0, 2]


def test_health_bodies_say_what_the_protocol_says(bundled: Server) -> None:
    """A v2 client reads the body, not only the status: `{}` would read as not live."""
    with bundled.client() as client:
        live = client.get("/v2/health/live")
        ready = client.get("/v2/health/ready")
    assert (live.status_code, live.json()) == (200, {"live": True})
    assert (ready.status_code, ready.json()) == (200, {"ready": True})


@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_http_against_the_real_server(bundled: Server, binary: bool) -> None:
    client = triton.InferenceServerClient(bundled.url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("mlp")
        metadata = client.get_model_metadata("mlp")
        assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]
        assert metadata["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 16]}]
        rows = np.random.default_rng(7).standard_normal((5, 256)).astype(np.float32)
        tensor = triton.InferInput("x", [5, 256], "FP32")
        tensor.set_data_from_numpy(rows, binary_data=binary)
        result = client.infer(
            "mlp", [tensor], outputs=[triton.InferRequestedOutput("y", binary_data=binary)]
        )
        np.testing.assert_allclose(result.as_numpy("y"), mlp_reference(rows), atol=1e-5)
    finally:
        client.close()


def batch_sizes(folder: Path) -> list[int]:
    """The rows of every batch the runner processes have logged so far (BATCHSERVE_BATCH_LOG)."""
    return [int(line.split(",")[0]) for log in sorted(folder.glob("*.csv"))
            for line in log.read_text().splitlines()[1:]]


def test_concurrent_requests_form_batches_within_the_cap(
    serve: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight times the cap queued at once behind a held batch: the runner's own batch log
    shows batches of several requests, the largest exactly the cap."""
    cap, sent = 8, 64  # PID_CONFIG's max_batch_size, and eight times it
    logs = tmp_path / "batches"
    monkeypatch.setenv("BATCHSERVE_BATCH_LOG", str(logs))
    config = PID_CONFIG.format(name="capped", model="gated_echo", latency=30000,
                               outputs="{name: y, datatype: FP32, shape: [-1, 4]}")
    config = config.replace("workers: 2\n", "workers: 1\n")  # one runner process: one queue
    server: Server = serve(config, "--api-workers", "2")  # type: ignore[operator]

    def post(value: float) -> httpx.Response:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                            "data": [value] * 4}]}
        with server.client() as client:
            return client.post("/v2/models/capped/infer", json=body)

    with ThreadPoolExecutor(sent + 1) as pool:
        try:
            held = pool.submit(post, -1.0)  # -1: the model holds its batch at the gate
            wait_for((tmp_path / "held").exists, 30, "the held batch to be in the model")
            futures = [pool.submit(post, float(i)) for i in range(sent)]
            wait_for(lambda: in_flight(server, "capped") == sent + 1, 30,
                     "every request queued at the runner behind the held batch")
        finally:
            (tmp_path / "gate").touch()
        answers = [future.result(timeout=30) for future in [held, *futures]]
    for value, answer in zip([-1.0, *range(sent)], answers, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [value] * 4
    wait_for(lambda: sum(batch_sizes(logs)) == sent + 1, 30, "the batch log to hold every row")
    sizes = batch_sizes(logs)
    assert all(size <= cap for size in sizes), sizes  # none over the cap
    assert max(sizes) == cap, sizes  # and batches of several requests, up to it


def test_requests_reach_every_runner_process(serve: object) -> None:
    server: Server = serve(PID_CONFIG.format(name="pids", model="pid_echo", latency=1000,  # type: ignore[operator]
                                             outputs=PID_OUTPUTS), "--api-workers", "2")
    runner_pids = set()
    for i in range(40):
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                            "data": [i, 0, 0, 0]}]}
        with server.client() as client:  # a new connection, so either API worker may answer
            answer = client.post("/v2/models/pids/infer", json=body)
        assert answer.status_code == 200, answer.text
        outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
        assert outputs["echo"] == [i, 0, 0, 0]
        runner_pids.add(outputs["pid"][0])
    assert runner_pids == set(server.runners())


def in_flight(server: Server, runner: str) -> float:
    """Requests the API workers have sent to `runner` and not had answered yet."""
    with server.client() as client:
        text = client.get("/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "batchserve_inflight_requests"
               and sample.labels.get("runner") == runner)


DEAD_RUNNER = re.compile(
    r"runner 'gated' at unix:\S+ went away (while|before) running the request"
)
"""What a request in flight to a runner that dies is answered: not a refusal's words."""


def test_killed_runner_answers_in_flight_requests_and_is_replaced(serve: object) -> None:
    config = PID_CONFIG.format(name="gated", model="gated_echo", latency=30000,
                               outputs="{name: y, datatype: FP32, shape: [-1, 4]}")
    config = config.replace("workers: 2\n", "workers: 1\n")
    server: Server = serve(config, "--api-workers", "1")  # type: ignore[operator]
    runners = server.runners()
    assert len(runners) == 1
    held = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                        "data": [-1, 0, 0, 0]}]}  # -1: the model holds its batch at the gate

    def one(_: int) -> httpx.Response:
        with server.client() as client:
            return client.post("/v2/models/gated/infer", json=held)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        wait_for(lambda: in_flight(server, "gated") == 8, 30, "every request in flight")
        os.kill(runners[0], signal.SIGKILL)
        answers = [future.result(timeout=10) for future in futures]
    assert [answer.status_code for answer in answers] == [503] * 8
    assert all(answer.headers["retry-after"].isdigit() for answer in answers)
    errors = [answer.json()["error"] for answer in answers]
    found = [DEAD_RUNNER.fullmatch(error) for error in errors]
    assert all(found), errors
    # The batch at the gate had started; the requests queued behind it had not.
    assert "while" in {match[1] for match in found if match}, errors

    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}

    def served() -> bool:
        with server.client() as client:
            return client.post("/v2/models/gated/infer", json=body).status_code == 200

    wait_for(served, 120, "a replacement runner to serve again")
    replacements = server.runners()
    assert len(replacements) == 1 and runners[0] not in replacements


def test_a_killed_runners_calls_not_started_are_retried_on_its_peer(serve: object) -> None:
    config = PID_CONFIG.format(name="slow", model="slow_pid_echo", latency=10000,
                               outputs=PID_OUTPUTS)
    config = config.replace("max_batch_size: 8", "max_batch_size: 1")
    server: Server = serve(config, "--api-workers", "1")  # type: ignore[operator]
    victim, peer = server.runners()
    sent = 16
    in_flight = threading.Barrier(sent + 1)

    def one(i: int) -> httpx.Response:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                            "data": [i, 0, 0, 0]}]}
        with server.client() as client:
            in_flight.wait()
            return client.post("/v2/models/slow/infer", json=body)

    with ThreadPoolExecutor(sent) as pool:
        futures = [pool.submit(one, i) for i in range(sent)]
        in_flight.wait()
        # One request a batch, 300 ms each: each process runs one and queues the rest.
        threading.Event().wait(0.15)
        os.kill(victim, signal.SIGKILL)
        answers = [future.result(timeout=30) for future in futures]
    statuses = sorted(answer.status_code for answer in answers)
    # The one running on the killed process fails at once; every queued one runs on the peer.
    assert statuses == [200] * (sent - 1) + [503], statuses
    (failed,) = [answer for answer in answers if answer.status_code == 503]
    assert failed.headers["retry-after"].isdigit()
    assert failed.json()["error"].endswith("went away while running the request")
    pids = {output["data"][0] for answer in answers if answer.status_code == 200
            for output in answer.json()["outputs"] if output["name"] == "pid"}
    assert pids == {peer}
