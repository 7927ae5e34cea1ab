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
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from batchserve.api.bench import bench, http1, load_result, probe, traffic
from batchserve.api.bench import plot as bench_plot
from batchserve.api.bench import report as bench_report
from batchserve.api.bench.http1 import ProtocolError, ResponseParser
from batchserve.api.bench.loadgen import Progress, run_load
from batchserve.api.bench.progress_bar import render
from batchserve.api.bench.scrape import Scrape
from tests.conftest import Server

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
        return Response(b'{"error": "busy", "reason": "front"}', status_code=503,
                        headers={"Retry-After": "1"})

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

    async def metadata(request):
        # A v2 server's model metadata, which the bench makes its requests from.
        return Response(b'{"name": "mlp", "inputs": [{"name": "x", "datatype": "FP32", '
                        b'"shape": [-1, 256]}], "outputs": []}', media_type="application/json")

    app = Starlette(routes=[
        Route("/ok", ok, methods=["POST"]),
        Route("/v2/models/mlp", metadata),
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
    assert result.retry_after_by_reason == {"front": {"1": result.sent}}


def test_a_503_without_a_reason_or_retry_after_counts_under_none(server: str) -> None:
    result = _load(f"{server}/alternate/unnamed", seed=3)
    refused = result.status_counts["503"]
    assert refused > 0 and result.retry_after_by_reason == {"none": {"none": refused}}


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
    """A target without /metrics is still benchmarked; the limit falls back to its default."""
    argv = ["--url", server, "--rate", "50", "--seconds", "0.3", "--binary", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["limit_ms"], report["limit_source"].split(";")[0]) == (100.0, "default")
    (step,) = report["steps"]
    assert step["sent"] == step["ok"] == step["status_counts"]["200"] > 0
    assert step["mean_batch_size"] is None
    assert set(step) >= {"p50_ms", "p99_ms", "error_fraction", "loadgen_cpu_ms_per_req"}


def test_cli_rejects_a_non_positive_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--rate", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_result_as_dict_is_json_ready(server: str) -> None:
    result = _load(f"{server}/ok", rate=20.0, seconds=0.2)
    assert json.loads(json.dumps(result.as_dict()))["sent"] == result.sent


# -- traffic patterns (pure: seeded schedules, no clock)


def _expected(segments: list[traffic.Segment]) -> float:
    return sum(seg.rate * (seg.end - seg.start) for seg in segments)


@pytest.mark.parametrize("pattern", ["poisson", "burst", "step"])
def test_every_pattern_offers_the_mean_rate(pattern: traffic.Pattern) -> None:
    assert _expected(traffic.profile(pattern, 40.0, 6.0)) == pytest.approx(240.0)


def test_burst_sends_at_four_times_the_rate_for_a_quarter_of_each_period() -> None:
    segments = traffic.profile("burst", 400.0, 3.0)
    assert segments == [
        traffic.Segment(0.0, 0.25, 1600.0), traffic.Segment(0.25, 1.0, 0.0),
        traffic.Segment(1.0, 1.25, 1600.0), traffic.Segment(1.25, 2.0, 0.0),
        traffic.Segment(2.0, 2.25, 1600.0), traffic.Segment(2.25, 3.0, 0.0),
    ]
    offsets = traffic.schedule(400.0, 10.0, seed=11, pattern="burst")
    per_period = [0] * 10
    for t in offsets:
        assert t % 1.0 < 0.25, f"an arrival at {t} s falls in an off period"
        per_period[int(t)] += 1
    for count in per_period:  # Poisson with mean 400: within 4 standard deviations (4 x 20)
        assert 320 <= count <= 480, per_period


def test_step_runs_half_the_rate_then_one_and_a_half_times_it() -> None:
    assert traffic.profile("step", 200.0, 10.0) == [
        traffic.Segment(0.0, 5.0, 100.0), traffic.Segment(5.0, 10.0, 300.0),
    ]
    offsets = traffic.schedule(200.0, 10.0, seed=5, pattern="step")
    first = sum(1 for t in offsets if t < 5.0)
    second = len(offsets) - first
    assert 500 - 4 * 22 <= first <= 500 + 4 * 22  # mean 500, sd ~22
    assert 1500 - 4 * 39 <= second <= 1500 + 4 * 39  # mean 1500, sd ~39
    assert offsets == sorted(offsets) and offsets[-1] < 10.0


def test_poisson_pattern_is_the_default_schedule() -> None:
    assert traffic.schedule(50.0, 2.0, seed=3, pattern="poisson") == traffic.schedule(50.0, 2.0, 3)


def test_an_unknown_pattern_is_named() -> None:
    with pytest.raises(ValueError, match="pattern 'saw' is not one of poisson, burst, step"):
        traffic.profile("saw", 1.0, 1.0)  # type: ignore[arg-type]


# -- pieces of the report (pure)


def test_parser_keeps_the_first_body_of_each_failed_status() -> None:
    samples: dict[int, bytes] = {}
    parser = ResponseParser(samples)
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"
    bad = b'HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\n{"error":"a"}'
    worse = b'HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\n{"error":"b"}'
    assert parser.feed(ok + bad + worse + ok) == [200, 400, 400, 200]
    assert samples == {400: b'{"error":"a"}'}


def refused(reason: str, retry_after: str) -> bytes:
    body = b'{"error":"no","reason":"%s"}' % reason.encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: %s\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (retry_after.encode(), len(body), body))


def test_parser_counts_each_503s_retry_after_by_the_reason_its_body_names() -> None:
    retries: dict[str, dict[str, int]] = {}
    parser = ResponseParser(retries=retries)
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"
    stream = (refused("queue", "2") + ok + refused("queue", "3") + refused("front", "1")
              + refused("queue", "2"))
    statuses = [status for i in range(0, len(stream), 7) for status in parser.feed(stream[i:i + 7])]
    assert statuses == [503, 200, 503, 503, 503]
    assert retries == {"queue": {"2": 2, "3": 1}, "front": {"1": 1}}


def test_summary_orders_retry_afters_by_seconds_and_the_table_counts_them() -> None:
    retries = {"queue": {"10": 1, "2": 5, "none": 1}, "front": {"1": 3}}
    result = load_result.summarize(10.0, 1.0, [0.1] * 10, [503] * 10, [0.0] * 10, 1.0,
                                   (1, 0), 0.0, retries=retries)
    assert list(result.retry_after_by_reason) == ["front", "queue"]
    assert list(result.retry_after_by_reason["queue"]) == ["2", "10", "none"]
    step = bench_report.Step("poisson", result, None, {"front": 3, "queue": 7})
    table = bench_report.markdown(bench_report.Report("u", "mlp", 1.0, "x", (step,)))
    assert table.splitlines()[4].endswith(
        "| front 3, queue 7 | front 3×1 s; queue 5×2 s, 1×10 s, 1×none |")


BATCHES = """\
# TYPE batchserve_adaptive_batch_size histogram
batchserve_adaptive_batch_size_sum{{method="__call__",runner="mlp"}} {rows}
batchserve_adaptive_batch_size_count{{method="__call__",runner="mlp"}} {batches}
batchserve_adaptive_batch_size_sum{{method="__call__",runner="other"}} 1000.0
batchserve_adaptive_batch_size_count{{method="__call__",runner="other"}} 1.0
# TYPE batchserve_runner_latency_limit_seconds gauge
batchserve_runner_latency_limit_seconds{{pid="1",runner="mlp"}} 0.25
batchserve_runner_latency_limit_seconds{{pid="2",runner="mlp"}} 0.25
"""


def test_mean_batch_size_is_rows_over_batches_between_two_readings() -> None:
    before = Scrape.parse(BATCHES.format(rows=100.0, batches=50.0))
    after = Scrape.parse(BATCHES.format(rows=400.0, batches=100.0))
    assert probe.mean_batch_size(before, after, "mlp") == pytest.approx(6.0)
    assert probe.mean_batch_size(before, before, "mlp") is None  # no batches in between
    assert probe.mean_batch_size(None, after, "mlp") is None


REFUSALS = """
# TYPE batchserve_unavailable_total counter
batchserve_unavailable_total{{reason="front",runner="mlp"}} {shed}
batchserve_unavailable_total{{reason="queue",runner="mlp"}} {refused}
batchserve_unavailable_total{{reason="front",runner="other"}} 99.0
"""


def test_refusals_are_the_servers_503s_by_reason_between_two_readings() -> None:
    before = Scrape.parse(REFUSALS.format(shed=10.0, refused=4.0))
    after = Scrape.parse(REFUSALS.format(shed=25.0, refused=4.0))
    assert probe.refusals(before, after, "mlp") == {"front": 15}
    assert probe.refusals(before, before, "mlp") == {}
    assert probe.refusals(None, after, "mlp") is None  # a server without metrics
    step = bench_report.Step("poisson", _report(Path()).steps[0].load, 2.0, {"front": 15})
    table = bench_report.markdown(bench_report.Report("u", "mlp", 1.0, "x", (step,)))
    assert table.splitlines()[4].endswith("| front 15 | none |")


def test_latency_limit_is_read_once_however_many_runner_processes_state_it() -> None:
    scrape = Scrape.parse(BATCHES.format(rows=0.0, batches=0.0))
    assert probe.latency_limit_ms(scrape, "mlp") == pytest.approx(250.0)
    assert probe.latency_limit_ms(scrape, "absent") is None


def test_progress_bar_renders_its_share_of_the_run() -> None:
    line = render("40 req/s", Progress(2.5, 10.0, 400, 100, 98, 97))
    assert line == ("40 req/s [########......................]  2.5/10 s  sent 100/400  "
                    "answered 98  ok 97")


def _report(tmp_path: Path) -> bench_report.Report:
    def step(rate: float, p50: float) -> bench_report.Step:
        load = load_result.summarize(
            rate, 1.0, [p50 / 1e3] * int(rate), [200] * int(rate), [0.0] * int(rate), 1.0,
            (1, 0), 0.0, slo_ms=100.0,
        )
        return bench_report.Step("poisson", load, 2.0)

    return bench_report.Report("http://h", "mlp", 100.0, "--limit-ms", (step(20, 5), step(40, 7)))


def test_markdown_has_a_row_per_rate(tmp_path: Path) -> None:
    table = bench_report.markdown(_report(tmp_path))
    lines = table.splitlines()
    assert lines[0] == "http://h model mlp: goodput counts 2xx answers within 100 ms (--limit-ms)."
    assert lines[2].startswith("| pattern | offered req/s | sent req/s | ok req/s | 2xx | 503 |")
    assert lines[4] == ("| poisson | 20.0 | 20.0 | 20.0 | 20 | 0 | 0 | 5.0 | 5.0 | 5.0 | - | - "
                        "| 20.0 | 2.0 | - | none |")
    assert len(lines) == 6


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    bench_plot.plot(_report(tmp_path), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert bench.main(["--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err == "batchserve bench: --plot needs matplotlib: pip install 'batchserve[plot]'\n"
    assert not (tmp_path / "p.png").exists()


# -- the command line


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for default in ("server base URL (default: http://127.0.0.1:3000)",
                    "(default: mlp)", "mean requests per second (default: 100.0)",
                    "duration of each rate's run (default: 10.0)", "(default: poisson)",
                    "connection pool cap (default: 256)", "else 100)"):
        assert default in text


def test_cli_rejects_a_bad_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--sweep", "20,-1"])
    assert "'20,-1': every rate must be a positive number" in capsys.readouterr().err


def test_an_unreachable_target_fails_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert bench.main(["--url", url, "--rate", "20", "--seconds", "0.5"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"batchserve bench: cannot reach {url}: ")
    assert "Connection refused" in captured.err


# -- against the real server


def test_a_sweep_reports_rates_statuses_goodput_and_batches(
    bundled: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = {name: tmp_path / f"sweep.{name}" for name in ("json", "md", "png")}
    argv = ["--url", bundled.url, "--model", "iris_clf", "--sweep", "20,40", "--seconds", "1.5",
            "--binary",
            "--json", str(paths["json"]), "--markdown", str(paths["md"]),
            "--plot", str(paths["png"])]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # no failures, no warning, no progress bar off a terminal
    report = json.loads(paths["json"].read_text())
    assert report["limit_ms"] == 500.0  # iris_clf's max_latency_ms, as /metrics states it
    assert report["limit_source"] == "max_latency_ms of 'iris_clf' from /metrics"
    assert [step["target_rate"] for step in report["steps"]] == [20.0, 40.0]
    for i, step in enumerate(report["steps"]):
        scheduled = len(traffic.schedule(step["target_rate"], 1.5, seed=i))
        assert step["offered_rate"] == pytest.approx(scheduled / 1.5)
        assert 0 < step["send_rate"] <= step["offered_rate"]
        assert step["status_counts"] == {"200": scheduled} and step["ok"] == scheduled
        assert 0 < step["good"] <= scheduled
        assert 0 < step["goodput"] <= step["good"] / 1.5
        assert step["mean_batch_size"] >= 1.0
        assert step["refusals_by_reason"] == {}  # batchserve counted no 503
        assert step["retry_after_by_reason"] == {}  # and the client received none
        assert step["ok_p50_ms"] <= step["ok_p90_ms"] <= step["ok_p99_ms"]
    table = paths["md"].read_text()
    assert captured.out == table
    rows = [line for line in table.splitlines() if line.startswith("| poisson |")]
    assert len(rows) == 2
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_request_failing_exits_non_zero_with_a_sample_body(
    bundled: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--url", bundled.url, "--model", "iris_clf", "--parameter", "timeout=-1",
            "--rate", "20", "--seconds", "0.5"]
    assert bench.main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("batchserve bench: every request failed; the first answer: 400 ")
    (sample,) = [line for line in err if line.startswith("sample answer with status 400: ")]
    assert "parameters.timeout has value -1" in sample


def test_a_model_that_does_not_exist_fails_with_its_404(
    bundled: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--url", bundled.url, "--model", "absent", "--rate", "20", "--seconds", "0.3"]
    assert bench.main(argv) == 1
    err = capsys.readouterr().err
    assert err == (f"batchserve bench: GET {bundled.url}/v2/models/absent answered 404: "
                   '{"error":"model \'absent\' is not served here; known models: classify, '
                   'iris_clf, mlp, text, text_features, tokenize"}\n')
