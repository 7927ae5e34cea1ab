"""Shedding at the front: a worker that falls behind refuses at once, and recovers."""

from __future__ import annotations

import asyncio
import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx
import pytest

from batchserve.api.client.codec import ServerUnavailable
from batchserve.api.http.app import create_app
from batchserve.api.overload import ENGAGED, Gate, Shedder, backlog_s, watch
from batchserve.api.service import Service, unavailable_total
from batchserve.runner.core.config import parse
from benchmarks import retrying
from benchmarks.front_refusal import BODY, CONFIG, connect
from tests.conftest import Server
from tests.test_connection import request

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_only_a_standing_lag_sheds_and_a_busy_loop_that_catches_up_does_not() -> None:
    shedder = Shedder(target_s=0.005, window_s=0.2, ticks=3, rise_per_s=1.0, fall_per_s=0.5)
    for lag in [0.050, 0.050, 0.050, 0.001] * 5:  # late in bursts, timely between them
        shedder.observe(lag)
    assert shedder.share == 0.0
    for _ in range(3):
        shedder.observe(0.050)
    assert shedder.share == 0.0  # three late ticks of 60 ms: not yet a whole window
    shedder.observe(0.050)
    assert shedder.share == pytest.approx(0.06)  # it climbs by the time the tick took
    for _ in range(8):
        shedder.observe(0.050)
    assert shedder.share == pytest.approx(0.54)
    assert not shedder.admits(0.53, 0.0) and shedder.admits(0.54, 0.0)


def test_a_burst_the_loop_works_off_in_a_few_ticks_sheds_nothing() -> None:
    shedder = Shedder(target_s=0.010, window_s=0.1, ticks=5)
    for lag in [0.150, 0.080, 0.040, 0.020, 0.002]:  # a client's stall, then its backlog
        shedder.observe(lag)
    assert shedder.share == 0.0
    for _ in range(5):  # a standing lag of as much: it holds, and sheds from its third tick
        shedder.observe(0.040)
    assert shedder.share == pytest.approx(3 * 5.0 * 0.05)


def test_a_lag_that_holds_sheds_from_its_third_late_tick() -> None:
    """Overload beginning: each tick some 30 ms late, none much less than the one before. The
    window is full after three ticks; waiting for five would read, decode and send two more
    ticks' worth of requests whole."""
    shedder = Shedder(target_s=0.010, window_s=0.1, ticks=5)
    for lag in [0.030, 0.036, 0.028]:  # 28 ms is more than three quarters of 36
        shedder.observe(lag)
    assert shedder.share == pytest.approx(5.0 * 0.038)
    falling = Shedder(target_s=0.010, window_s=0.1, ticks=5)
    for lag in [0.030, 0.036, 0.026, 0.025]:  # 26 ms is less: counted again from it
        falling.observe(lag)
    assert falling.share == 0.0


def test_the_share_falls_back_when_the_lag_does_and_never_passes_the_ceiling() -> None:
    shedder = Shedder(window_s=0.02, ticks=1, rise_per_s=10.0, fall_per_s=5.0, ceiling=0.9)
    for _ in range(5):
        shedder.observe(1.0)
    assert shedder.share == 0.9
    shedder.observe(0.0)  # a timely tick of 10 ms
    assert shedder.share == pytest.approx(0.85)
    shedder.observe(0.005)  # half the target: half as fast
    assert shedder.share == pytest.approx(0.8125)
    shedder.observe(0.010)  # at the target it holds
    assert shedder.share == pytest.approx(0.8125)
    for _ in range(17):
        shedder.observe(0.0)
    assert shedder.share == 0.0
    assert shedder.admits(0.0, 0.0)


def test_while_shedding_a_request_read_with_the_next_tick_overdue_is_refused() -> None:
    shedder = Shedder(target_s=0.010, share=0.5, due=1.0)
    assert shedder.admits(0.9, 1.005)  # the tick is 5 ms overdue: within the target
    assert not shedder.admits(0.9, 1.02)
    assert shedder.behind_s(1.02) == pytest.approx(0.02)


def test_a_gate_ignores_a_few_refusals_and_acts_on_a_run_of_them() -> None:
    gate = Gate(step=0.02, tau_s=0.1)
    for _ in range(3):  # a stalled batch's few refusals: the runner explains those itself
        gate.refused(now=1.0)
    assert 0.0 < gate.share < ENGAGED
    assert gate.shares(1.0) == 0.0 and gate.admits(0.0, 1.0)
    for _ in range(30):  # a standing overload
        gate.refused(now=1.0)
    assert gate.shares(1.0) == pytest.approx(1 - 0.98 ** 33)
    assert not gate.admits(0.4, 1.0) and gate.admits(0.5, 1.0)


def test_a_gate_forgets_within_a_few_time_constants() -> None:
    gate = Gate(step=0.5, tau_s=0.1, ceiling=0.95)
    for _ in range(10):
        gate.refused(now=0.0)
    assert gate.shares(0.0) == 0.95
    assert gate.shares(0.1) == pytest.approx(0.95 / math.e)
    assert gate.shares(0.3) == 0.0 and gate.admits(0.0, 0.3)  # under ENGAGED: nothing refused


async def test_watch_measures_how_long_the_loop_was_blocked_and_records_it() -> None:
    shedder, recorded = Shedder(), []
    task = asyncio.create_task(watch(shedder, lambda: True, asyncio.Event(), period_s=0.02,
                                     record=recorded.append))
    await asyncio.sleep(0.01)  # the watcher is now asleep on its 20 ms timer
    time.sleep(0.05)  # noqa: ASYNC251 - the point: a blocked loop, its timer some 40 ms late
    await asyncio.sleep(0.01)  # the late tick runs; the next is not due yet
    task.cancel()
    assert shedder.lag_s >= 0.035
    assert recorded and recorded[-1] == shedder.lag_s


async def test_an_idle_watch_sets_no_timer_until_a_request_wakes_it() -> None:
    shedder, recorded, published = Shedder(), [], []
    busy, woken = [False], asyncio.Event()
    ticked, idle_again = asyncio.Event(), asyncio.Event()

    def record(lag_s: float) -> None:
        recorded.append(lag_s)
        if len(recorded) == 3:
            ticked.set()

    def publish() -> None:
        published.append(busy[0])
        if len(published) == 2:
            idle_again.set()

    task = asyncio.create_task(watch(shedder, lambda: busy[0], woken, period_s=0.001,
                                     record=record, publish=publish))
    await asyncio.sleep(0.05)
    assert recorded == [] and published == [False]  # idle: published once, then asleep
    busy[0] = True
    woken.set()
    await asyncio.wait_for(ticked.wait(), 5)
    busy[0] = False
    await asyncio.wait_for(idle_again.wait(), 5)
    ticks = len(recorded)
    await asyncio.sleep(0.05)
    task.cancel()
    assert published[-1] is False  # the last publish saw the idle state
    assert len(recorded) == ticks  # and no tick came after it


async def test_a_shedding_worker_answers_503_with_retry_after_before_reading_the_body() -> None:
    app = create_app(parse(__import__("yaml").safe_load(CONFIG)), {})
    app.service.shedder.share = 1.0
    app.service.shedder.lag_s = 0.0123
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [0] * 256}]}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        alone = await client.post("/v2/models/mlp/infer", json=body)
        app.service.inflight = 1  # another request in flight: a backlog to shed for
        answer = await client.post("/v2/models/mlp/infer", json=body)
        unknown = await client.post("/v2/models/nope/infer", json=body)
    # With nothing else in flight there is no backlog: it goes on (to no runner, here).
    assert alone.json() == {"error": "no process of runner 'mlp' is reachable",
                            "reason": "unreachable"}
    assert answer.status_code == 503
    # Turning all away (counted as the most it ever sheds, 95%) refuses 19 s of work a second.
    assert answer.headers["retry-after"] == "20"
    assert answer.json() == {
        "error": "the server is overloaded (this API worker runs 12 ms behind); retry later",
        "reason": "front", "lag_ms": 12.3,
    }
    assert unknown.status_code == 404  # a wrong URL is still told what is wrong
    assert app.service.inflight == 1


async def test_a_front_refusal_builds_no_exchange_and_writes_the_bytes_it_wrote_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a worker sheds, most of what arrives is refused at its headers; such a refusal
    is written from the bytes kept for the same words, with no exchange built for it, and
    is counted as any 503 is."""
    app = create_app(parse(__import__("yaml").safe_load(CONFIG)), {})
    service = app.service
    built: list[str] = []
    admit = Service.request
    monkeypatch.setattr(Service, "request", lambda self, name, version, respond: (
        built.append(name), admit(self, name, version, respond))[1])
    monkeypatch.setattr(time, "time", lambda: 1.8e9)  # one date line for every answer
    connection, transport = connect(app)
    service.shedder.share, service.shedder.lag_s = 1.0, 0.0123
    service.inflight = 1  # another request in flight: a backlog to shed for
    answered = service.answered
    fronts = unavailable_total.labels("mlp", "front", "http")
    counted = fronts._value.get()
    try:
        for _ in range(3):
            connection.data_received(request("/v2/models/mlp/infer", BODY))
        connection.data_received(request("/v2/models/nope/infer", BODY))
        assert not transport.closed  # a refusal keeps the connection
    finally:
        connection.connection_lost(None)
    first, second, third, unknown = transport.written
    assert second is first and third is first  # written again as they were, not rebuilt
    head, _, content = first.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 20\r\n" in head
    assert json.loads(content) == {
        "error": "the server is overloaded (this API worker runs 12 ms behind); retry later",
        "reason": "front", "lag_ms": 12.3,
    }
    assert built == ["nope"]  # only the request that is not refused at its headers
    assert unknown.startswith(b"HTTP/1.1 404 ")
    assert service.answered == answered + 4 and service.inflight == 1  # the 404 as well
    service.flush()
    assert fronts._value.get() == counted + 3


@pytest.mark.parametrize(("share", "behind_s", "backlog"), [
    (0.0, 0.0, 0.0),
    (0.5, 0.0, 1.0),  # half turned away: a second of work refused every second
    (0.8, 0.25, 4.25),  # four fifths: four seconds, and the loop a quarter second behind
    (1.0, 0.0, 19.0),  # never more than the most a controller sheds
])
def test_a_front_sheds_backlog_is_the_work_its_share_refuses_a_second(
    share: float, behind_s: float, backlog: float
) -> None:
    assert backlog_s(share, behind_s) == pytest.approx(backlog)


def limits(*max_latency_ms: float) -> str:
    """A configuration of one `mlp` runner per limit."""
    return "runners:\n" + "".join(
        f"""  mlp{i}:
    model: batchserve.runner.bundled:mlp
    batching: {{max_latency_ms: {limit}}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 256]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 16]}}]
"""
        for i, limit in enumerate(max_latency_ms)
    )


@pytest.mark.parametrize(("max_latency_ms", "target_s"), [
    ((100, 30000), 0.010),  # the loop must keep up with the tightest runner
    ((30000,), 3.0),  # a 10 ms lag is no backlog to a 30 s limit: nothing to shed for
    ((20, 500), 0.010),  # below 10 ms a lag on shared cores is the scheduler's turn
])
def test_the_lag_target_is_a_tenth_of_the_tightest_limit_and_at_least_10_ms(
    max_latency_ms: tuple[float, ...], target_s: float
) -> None:
    config = parse(__import__("yaml").safe_load(limits(*max_latency_ms)))
    assert create_app(config, {}).service.shedder.target_s == pytest.approx(target_s)


GATED_TWO = """
api: {{workers: 1, max_inflight: {limit}}}
runners:
  gated:
    model: fixture_models:gated_echo
    batching: {{max_batch_size: 8, max_latency_ms: 30000}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 4]}}]
"""


def test_requests_past_max_inflight_are_refused_and_the_connection_serves_on(
    serve: object, tmp_path: Path
) -> None:
    server: Server = serve(GATED_TWO.format(limit=2))  # type: ignore[operator]
    held = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [-1, 2, 3, 4]}]}
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}

    def one(_: int) -> int:
        with server.client() as client:
            return client.post("/v2/models/gated/infer", json=held).status_code

    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(one, i) for i in range(8)]
        # The model holds the first two until the gate opens: the other six are refused.
        early = wait_for_count(calls, 6)
        assert [call.result() for call in early] == [503] * 6
        with server.client() as client:  # one keep-alive connection: refused, then served
            refused = client.post("/v2/models/gated/infer", json=body)
            (tmp_path / "gate").touch()
            assert [call.result(timeout=30) for call in calls if call not in early] == [200, 200]
            served = client.post("/v2/models/gated/infer", json=body)
    assert refused.status_code == 503
    assert refused.json()["error"] == (
        "the server is overloaded (2 requests in flight in this API worker); retry later"
    )
    assert served.status_code == 200


def wait_for_count(calls: list[Future[int]], count: int) -> list[Future[int]]:
    """The first `count` of `calls` to finish, once they have (at most 30 s)."""
    finished: list[Future[int]] = []
    for call in as_completed(calls, timeout=30):
        finished.append(call)
        if len(finished) == count:
            return finished
    raise AssertionError(f"only {len(finished)} of {len(calls)} calls finished")


def _refused(retry_after: str) -> httpx.Response:
    return httpx.Response(503, headers={"Retry-After": retry_after},
                          json={"error": "busy", "reason": "queue"})


def test_a_retrying_client_waits_what_the_server_says_or_a_fixed_second() -> None:
    assert retrying.wait_s("honour", _refused("3"), 5.0) == 3.0
    assert retrying.wait_s("fixed-1s", _refused("3"), 5.0) == 1.0
    assert retrying.wait_s("honour", httpx.Response(200), 5.0) is None
    with pytest.raises(ServerUnavailable):  # the wait would pass the bound: given up
        retrying.wait_s("honour", _refused("3"), 2.0)
    assert retrying.wait_s("fixed-1s", _refused("3"), 2.0) == 1.0


def test_the_retrying_comparison_accounts_for_every_request(serve: object) -> None:
    """Both variants over one short schedule at three times the capacity: each fresh request
    ends once (answered, given up or failed), and every retry followed a 503 it met."""
    server: Server = serve(retrying.CONFIG)  # type: ignore[operator]
    outcomes = asyncio.run(retrying.compare(server.url, 3 * retrying.CAPACITY_RPS, 1.5,
                                            give_up_s=2.0, pause_s=0.5))
    assert [outcome.variant for outcome in outcomes] == ["fixed-1s", "honour"]
    fresh = outcomes[0].fresh
    for outcome in outcomes:
        assert outcome.fresh == fresh > 0
        assert outcome.succeeded + outcome.gave_up + outcome.failed == fresh
        assert outcome.first_try <= outcome.succeeded == len(outcome.to_success_s)
        assert len(outcome.answered_at_s) == outcome.succeeded
        met = sum(sum(values.values()) for values in outcome.retry_after.values())
        assert outcome.sent - fresh <= met, outcome.retry_after
        assert "queue" in outcome.retry_after, outcome.retry_after
        assert retrying.table([outcome]).count("\n| ") == 1


def test_a_flush_writes_every_answer_held_since_the_last_and_a_rare_one_goes_at_once() -> None:
    """200s and the worker's own overload 503s are tallied in the process and written in bulk
    by `flush`, which visits only what was tallied since the last one; any other 503 is
    written at once, so a scrape right after it counts it."""
    from prometheus_client import REGISTRY

    config = parse(__import__("yaml").safe_load(limits(100)))
    service = create_app(config, {}).service

    def counts() -> tuple[float, ...]:
        value = REGISTRY.get_sample_value
        return tuple(value(name, labels) or 0.0 for name, labels in (
            ("batchserve_requests_total", {"runner": "mlp0", "code": "200", "protocol": "http"}),
            ("batchserve_requests_total", {"runner": "mlp0", "code": "503", "protocol": "http"}),
            ("batchserve_unavailable_total",
             {"runner": "mlp0", "reason": "front", "protocol": "http"}),
            ("batchserve_unavailable_total",
             {"runner": "mlp0", "reason": "queue", "protocol": "http"})))

    def moved(before: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(now - then for now, then in zip(counts(), before, strict=True))

    start = counts()
    started = time.monotonic()
    for _ in range(3):
        service.observe("mlp0", 200, started, "")
    for _ in range(2):
        service.observe("mlp0", 503, started, "front")
    assert moved(start) == (0, 0, 0, 0)
    # The runner's refusal is written at once, with the 503s held before it.
    service.observe("mlp0", 503, started, "queue")
    assert moved(start) == (0, 3, 0, 1)
    service.flush()
    assert moved(start) == (3, 3, 2, 1)
    service.flush()  # nothing new: nothing moves
    service.observe("mlp0", 200, started, "")
    service.flush()
    assert moved(start) == (4, 3, 2, 1)


async def test_the_front_refusal_benchmark_measures_both_paths() -> None:
    from benchmarks.front_refusal import measure

    figures = await measure(50)
    assert list(figures) == ["shed at the front", "read, decoded, checked"]
    assert all(micros > 0 for micros in figures.values())
