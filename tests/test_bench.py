"""The open-loop load generator, against a tiny real uvicorn server in a subprocess."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import httpx
import numpy as np
import orjson
import pytest

from batchserve.api import bench, http1, load_result, traffic
from batchserve.api.http1 import ProtocolError, ResponseParser
from batchserve.api.loadgen import run_load

APP = textwrap.dedent(
    """
    import asyncio
    from collections import Counter

    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    seen = Counter()

    async def ok(request):
        await request.body()
        return Response(b'{"ok": true}', media_type="application/json")

    async def busy(request):
        return Response(b'{"error": "busy"}', status_code=503, headers={"Retry-After": "1"})

    async def alternate(request):
        # Every second request on a key is refused: the client must count exactly half.
        key = request.path_params["key"]
        seen[key] += 1
        return Response(b"", status_code=503 if seen[key] % 2 == 0 else 200)

    async def slow(request):
        await asyncio.sleep(0.05)
        return Response(b"slow")

    async def hang(request):
        await asyncio.sleep(30)
        return Response(b"late")

    app = Starlette(routes=[
        Route("/ok", ok, methods=["POST"]),
        Route("/v2/models/mlp/infer", ok, methods=["POST"]),
        Route("/busy", busy, methods=["POST"]),
        Route("/alternate/{key}", alternate, methods=["POST"]),
        Route("/slow", slow, methods=["POST"]),
        Route("/hang", hang, methods=["POST"]),
    ])
    """
)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"test server exited with {proc.returncode}")
        try:
            if httpx.post(f"{url}/ok", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"test server at {url} not ready after {timeout} s")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-worker uvicorn server on a socket bound here (no free-port race)."""
    app_dir = tmp_path_factory.mktemp("tiny_app")
    (app_dir / "tiny_app.py").write_text(APP)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.set_inheritable(True)
    port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "uvicorn", "tiny_app:app", "--app-dir", str(app_dir)]
    cmd += ["--fd", str(sock.fileno()), "--log-level", "warning", "--no-access-log"]
    cmd += ["--timeout-graceful-shutdown", "1"]  # /hang handlers never finish
    proc = subprocess.Popen(cmd, pass_fds=[sock.fileno()])
    sock.close()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _load(
    url: str, rate: float = 100.0, seconds: float = 1.0, **kw: object
) -> load_result.LoadResult:
    return asyncio.run(run_load(url, b"{}", {}, rate, seconds, **kw))  # type: ignore[arg-type]


# -- pure parts


def test_schedule_is_deterministic_increasing_and_inside_the_window() -> None:
    offsets = traffic.schedule(200.0, 2.0, seed=7)
    assert offsets == traffic.schedule(200.0, 2.0, seed=7)
    assert offsets != traffic.schedule(200.0, 2.0, seed=8)
    assert all(a < b for a, b in zip(offsets, offsets[1:], strict=False))
    assert 0 < offsets[0] and offsets[-1] < 2.0


@pytest.mark.parametrize(("rate", "seconds"), [(0, 1), (10, 0), (-1, 1)])
def test_schedule_rejects_non_positive_values(rate: float, seconds: float) -> None:
    with pytest.raises(ValueError, match="rate and seconds must be positive"):
        traffic.schedule(rate, seconds)


def test_encode_request_sets_host_and_length_once() -> None:
    raw = http1.encode_request("POST", "/p", "h:1", {"content-length": "9", "X-A": "b"}, b"abc")
    assert raw == b"POST /p HTTP/1.1\r\nHost: h:1\r\nContent-Length: 3\r\nX-A: b\r\n\r\nabc"


def test_target_rejects_https() -> None:
    with pytest.raises(ValueError, match="must be http://"):
        http1.Target.from_url("https://example.org/", b"", {})


def test_parser_reads_responses_split_anywhere_and_back_to_back() -> None:
    one = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
    two = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n\r\n"
    stream = one + two + one
    for cut in range(1, len(stream)):
        parser = ResponseParser()
        assert parser.feed(stream[:cut]) + parser.feed(stream[cut:]) == [200, 503, 200]


def test_parser_notes_connection_close_and_refuses_chunked() -> None:
    parser = ResponseParser()
    assert parser.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert parser.keep_alive is False
    with pytest.raises(ProtocolError, match="transfer-encoding"):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert load_result.percentile(values, 0.5) == 50.0
    assert load_result.percentile(values, 0.99) == 99.0
    assert load_result.percentile(values, 1.0) == 100.0
    assert load_result.percentile([], 0.5) is None


def test_summary_splits_ok_and_refused_latencies_and_counts_good_answers() -> None:
    latencies = [0.010, 0.050, 0.150, 0.002, 0.004, 0.0]
    statuses = [200, 200, 200, 503, 503, load_result.TRANSPORT_ERROR]
    result = load_result.summarize(1.0, 6.0, latencies, statuses, [0.0] * 6, 6.0, (1, 0), 0.0,
                               slo_ms=100.0)
    assert (result.ok, result.good) == (3, 2)  # the 150 ms answer is OK but not good
    assert (result.ok_p50_ms, result.ok_p99_ms) == pytest.approx((50.0, 150.0))
    assert result.refused_p99_ms == pytest.approx(4.0)
    assert result.p99_ms == pytest.approx(150.0)  # every answer, 503s included
    assert result.error_fraction == {"503": 2 / 6, "transport": 1 / 6}


def test_json_infer_body_is_a_v2_request() -> None:
    body, headers = bench.infer_body(3, 256, binary=False)
    request = orjson.loads(body)
    (tensor,) = request["inputs"]
    assert (tensor["name"], tensor["datatype"], tensor["shape"]) == ("x", "FP32", [3, 256])
    assert len(tensor["data"]) == 3 * 256
    assert request["outputs"] == [{"name": "y"}]
    assert headers == {"Content-Type": "application/json"}


def test_binary_infer_body_follows_the_binary_extension() -> None:
    body, headers = bench.infer_body(2, 256, binary=True, seed=3)
    size = int(headers["Inference-Header-Content-Length"])
    header = orjson.loads(body[:size])
    (tensor,) = header["inputs"]
    assert tensor["parameters"] == {"binary_data_size": 2 * 256 * 4}
    assert "data" not in tensor
    assert header["outputs"] == [{"name": "y", "parameters": {"binary_data": True}}]
    data = np.frombuffer(body[size:], dtype="<f4").reshape(2, 256)
    json_data = orjson.loads(bench.infer_body(2, 256, binary=False, seed=3)[0])
    np.testing.assert_array_equal(data.ravel(), np.float32(json_data["inputs"][0]["data"]))


# -- against a real server


def test_every_scheduled_request_is_sent_and_answered(server: str) -> None:
    result = _load(f"{server}/ok", seed=1)
    assert result.sent == len(traffic.schedule(100.0, 1.0, seed=1))
    assert result.answered == result.ok == result.sent
    assert result.errors == 0.0 and result.error_fraction == {}
    assert result.p50_ms is not None and result.max_ms is not None
    assert 0 < result.p50_ms <= result.max_ms
    assert 1 <= result.peak_connections <= 256


def test_503_answers_are_errors_by_status(server: str) -> None:
    result = _load(f"{server}/busy")
    assert result.answered == result.sent and result.ok == 0
    assert result.error_fraction == {"503": 1.0}
    assert result.errors == 1.0


def test_errors_are_counted_exactly(server: str) -> None:
    result = _load(f"{server}/alternate/exact", seed=2)
    refused = result.sent // 2
    assert result.ok == result.sent - refused
    assert result.error_fraction == {"503": refused / result.sent}


def test_latency_runs_from_the_scheduled_time_when_queued_client_side(server: str) -> None:
    """Two connections, 50 ms answers, 100 req/s: requests queue in the client.

    A closed-loop client would report ~50 ms for all of them. Counted from their schedule,
    the last answers must wait for every earlier one: a lower bound, not a timing guess.
    """
    result = _load(f"{server}/slow", seconds=0.5, max_connections=2, seed=3)
    offsets = traffic.schedule(100.0, 0.5, seed=3)
    assert result.ok == result.sent == len(offsets)
    assert result.peak_connections <= 2 and result.peak_queued > 0
    service = 0.045  # the server sleeps 50 ms; its timer may fire up to ~1 ms early
    lower_bound = offsets[0] + math.ceil(len(offsets) / 2) * service - offsets[-1]
    assert result.max_ms is not None and result.max_ms / 1e3 >= lower_bound


def test_unanswered_requests_time_out(server: str) -> None:
    result = _load(f"{server}/hang", rate=20.0, seconds=0.2, seed=4, drain_timeout=0.2)
    assert result.sent > 0 and result.answered == 0
    assert result.error_fraction == {"timeout": 1.0}


def test_refused_connections_are_transport_errors() -> None:
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        result = _load(f"http://127.0.0.1:{port}/ok", rate=50.0, seconds=0.2, max_connections=1)
    assert result.sent > 0 and result.answered == 0
    assert result.error_fraction == {"transport": 1.0}


def test_cli_prints_json(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", server, "--rate", "50", "--seconds", "0.3", "--binary", "--json"]
    assert bench.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sent"] == result["ok"] > 0
    assert set(result) >= {"p50_ms", "p99_ms", "error_fraction", "loadgen_cpu_ms_per_req"}


def test_cli_rejects_a_non_positive_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--rate", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_result_as_dict_is_json_ready(server: str) -> None:
    result = _load(f"{server}/ok", rate=20.0, seconds=0.2)
    assert json.loads(json.dumps(result.as_dict()))["sent"] == result.sent
