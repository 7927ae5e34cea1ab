"""The peer sweep's own parts: answer checks, CPU accounting, the verdicts and the profile steps.

The other servers need venvs of their own (``python -m benchmarks.peers --install``), so only
batchserve is started here, for real, through the same launcher the sweep uses.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import orjson
import pytest

from batchserve.api.bench.cpu import server_cpu
from batchserve.api.bench.load_result import LoadResult, summarize
from benchmarks.peers import report
from benchmarks.peers.launch import WrongAnswer, check, started
from benchmarks.peers.model_limit import reference
from benchmarks.peers.servers import PEERS
from benchmarks.peers.sweep import Run, client_limit
from benchmarks.request_path import OTHER, step_of
from tests.conftest import wait_for

ROW = np.random.default_rng(0).standard_normal(256, dtype=np.float32).tolist()


def run(server: str, round_: int, rate: float, p99_ms: float, failed: int = 0) -> Run:
    """A made-up run of 1,000 requests: 98% at 1 ms, 2% at ``p99_ms``, ``failed`` of them 503."""
    latencies = [0.001] * 980 + [p99_ms / 1e3] * 20
    statuses = [503] * failed + [200] * (1000 - failed)
    load = summarize(rate, 1.0, latencies, statuses, [0.0] * 1000, 1.0, (1, 0), 0.0)
    return Run(server, round_, rate, load, cpu_s=0.5, processes=3)


def test_a_rate_passes_only_when_every_round_passes() -> None:
    runs = [run("a", 0, 100, 5), run("a", 1, 100, 5), run("a", 0, 400, 5),
            run("a", 1, 400, 150), run("a", 0, 800, 5), run("a", 1, 800, 5, failed=9)]
    assert [r.passed for r in runs] == [True, True, True, False, True, True]
    assert report.best_rate(runs, "a", [100, 400, 800]) == 800
    assert report.kept_up_rate(runs, "a", [100, 400, 800]) == 800
    runs.append(run("a", 1, 800, 5, failed=10))  # 1% non-OK: 800 no longer passes
    assert report.best_rate(runs, "a", [100, 400, 800]) == 100
    assert report.kept_up_rate(runs, "a", [100, 400, 800]) == 400
    assert report.best_rate(runs, "nobody", [100]) is None


def test_the_summary_reads_goodput_at_one_and_a_half_and_twice_the_best_rate() -> None:
    runs = [run("a", 0, 100, 5), run("a", 0, 400, 500), run("a", 0, 150, 5), run("a", 0, 200, 5)]
    summary = report.summarize(runs, "a", [100, 400])
    assert summary.best_rate == 100
    assert list(summary.goodput) == [150, 200]
    assert summary.cpu_ms_per_req[100.0] == pytest.approx(0.5)
    assert "| a | 100 | 400 |" in report.table([summary], model_limit=1000.0)


def test_a_run_says_when_its_clients_connections_held_requests_back() -> None:
    def load(peaks: tuple[int, int]) -> LoadResult:
        return summarize(100, 1.0, [0.01] * 10, [200] * 10, [0.0] * 10, 1.0, peaks, 0.0)

    # Ours queues a few requests while its pool grows: no limit. Past one a connection, it is.
    assert client_limit(load((256, 8)), shared=False) == ""
    said = client_limit(load((256, 26785)), shared=False)
    assert "all 256 connections busy" in said and "up to 26785 requests waiting" in said
    # A shared client counts requests it never sent: any at all is its limit.
    assert client_limit(load((1024, 0)), shared=True) == ""
    assert "3 requests not sent" in client_limit(load((1024, 3)), shared=True)


def test_an_answer_is_checked_against_the_models_own_output() -> None:
    peer = PEERS["mosec"]
    expected = reference(ROW)
    check(peer, {"y": expected}, expected)
    with pytest.raises(WrongAnswer, match="16 outputs, worst difference 0.5"):
        check(peer, {"y": [v + 0.5 for v in expected]}, expected)
    with pytest.raises(WrongAnswer, match="mosec: no outputs in"):
        check(peer, {"detail": "not found"}, expected)


def test_batchserve_starts_answers_the_row_and_stops_with_all_its_processes(
    tmp_path: Path,
) -> None:
    peer = PEERS["batchserve"]
    body = orjson.dumps(peer.body(ROW))
    with started(peer, body, reference(ROW), tmp_path / "server.log") as server:
        pids = [pid for pid, _ in server_cpu(server.pid)]
        assert len(pids) >= 4  # supervisor, its API worker, the runners (five bundled)
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 10, "exit")


CHILDREN = textwrap.dedent(
    """
    import os, subprocess, sys, time
    # One child in a session of its own, one reparented to init by a double fork; each
    # prints its pid, and the orphan burns 0.3 s of CPU first.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    print(child.pid, flush=True)
    if os.fork() == 0:
        if os.fork() == 0:
            t = time.process_time()
            while time.process_time() - t < 0.3:
                pass
            print(os.getpid(), flush=True)
            time.sleep(60)
        os._exit(0)
    time.sleep(60)
    """
)


def test_server_cpu_counts_children_in_new_sessions_and_orphans_of_its_session() -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILDREN], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child, orphan = int(proc.stdout.readline()), int(proc.stdout.readline())
    try:
        counted = {pid: ticks for (pid, _), ticks in server_cpu(proc.pid).items()}
        assert {proc.pid, child, orphan} <= counted.keys()
        assert counted[orphan] >= 20  # 0.3 s at 100 ticks a second, give or take a tick
        assert Path(f"/proc/{orphan}/stat").read_text().split(") ")[1].split()[1] == "1"
    finally:
        for pid in (child, orphan, proc.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize(("stack", "step"), [
    (["process 1:\"x\"", "run (asyncio/runners.py:118)", "handle (api/http/app.py:200)",
      "decode_infer (api/protocol.py:312)", "from_json (api/tensors.py:170)"],
     "v2 JSON decode + validate"),
    (["run_forever (asyncio/base_events.py:608)", "_run (asyncio/events.py:84)"],
     "event loop, sockets (uvloop, asyncio)"),
    (["serve (runner/server.py:196)", "forward (torch/nn/modules/linear.py:125)"],
     "model forward (torch)"),
    (["data_received (uvicorn/protocols/http/httptools_impl.py:170)",
      "on_headers_complete (api/http/connection.py:194)", "admit (api/service.py:319)"],
     "API: the exchange (admission, answer, response)"),
    (["Thread._bootstrap_inner (threading.py:1045)", "Thread.run (threading.py:982)"],
     "gRPC: grpc.aio's poller thread (C-core completion queue)"),
    (["Thread.run (threading.py:982)", "_worker (concurrent/futures/thread.py:81)"],
     "runner: thread-pool handoff to the model thread"),
    (["Runner.run (asyncio/runners.py:118)", "InferenceService.model_infer "
      "(api/grpc/server.py:182)", "decode_infer (api/grpc/codec.py:108)"],
     "gRPC door: decode, encode (protobuf)"),
    (["main (<string>:1)"], OTHER),
])
def test_a_stack_is_charged_to_its_innermost_known_step(stack: list[str], step: str) -> None:
    assert step_of(stack) == step
