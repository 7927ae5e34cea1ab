"""Liveness: with requests queued and the model idle, a batch starts within the window.

Faults are injected on the fake clock (the policy alone, every decision exact), in the live
dispatcher (a real event loop and model thread), and in a real server: a model call that
stalls, a refit that raises or does not come back, a clock that jumps, a burst of a thousand
requests in ten milliseconds, an answer that cannot be sent.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchserve.api.bench.load_result import LoadResult
from batchserve.api.bench.loadgen import Progress, run_load
from batchserve.runner.core.types import Tensors
from batchserve.runner.core.wire import FailureCode
from batchserve.runner.dispatcher import Rejection
from batchserve.runner.policy.adaptive import AdaptivePolicy
from batchserve.runner.policy.base import Batch, Request
from batchserve.runner.policy.latency_model import Fit, Timing
from batchserve.runner.policy.tuning import Tuning
from tests.conftest import Server
from tests.test_dispatcher import Gate, ask, dispatcher, rows

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def calibrated(size: int = 64, latency_s: float = 0.1) -> AdaptivePolicy:
    policy = AdaptivePolicy(size, latency_s)
    policy.calibrate([Timing(n, 0.005 + 0.0005 * n, 0.005 + 0.0005 * n)
                      for n in policy.calibration_sizes()])
    return policy


def check_step(policy: AdaptivePolicy, now: float, running: bool, batch: Batch | None,
               wake_at: float | None) -> None:
    """The liveness rule at one poll of an idle model with work queued."""
    queue = policy._waiting.requests  # noqa: SLF001 - the rule is about the queue the policy holds
    if running or batch is not None or not queue:
        return
    assert wake_at is not None, "work queued, model idle, and no wake-up asked for"
    assert now < wake_at <= queue[0].arrival + policy.window_s + 1e-12


@pytest.mark.parametrize("seed", range(20))
def test_on_the_fake_clock_a_batch_starts_within_the_window_whatever_happens(seed: int) -> None:
    """Bursts, stalls of 200 ms, forward clock jumps and refits that never come back."""
    rng = random.Random(seed)
    policy = calibrated()
    now, ident, running, done_at = 0.0, 0, None, float("inf")
    wake = float("inf")
    for _ in range(3000):
        arrival = now + rng.expovariate(rng.choice((50.0, 2000.0, 1e5)))
        if rng.random() < 0.01:
            arrival += 10.0  # the clock jumps (a paused VM)
        now = min(arrival, done_at, wake)
        if now == done_at:
            assert running is not None
            stall = 0.2 if rng.random() < 0.02 else 0.0
            policy.complete(running, now - 0.006, now + stall, 0.006)
            running, done_at = None, float("inf")
            job = policy.refit_job(now)
            if job is not None and rng.random() < 0.7:  # else the refit failed: never applied
                policy.apply_fit(job())
        elif now == arrival:
            for _ in range(rng.choice((1, 1, 1, 50))):
                policy.offer(Request(ident, rng.randint(1, 8), now, now + 0.1), now)
                ident += 1
        wake = float("inf")
        step = policy.poll(now)
        check_step(policy, now, running is not None, step.batch, step.wake_at)
        if step.batch is not None:
            running = step.batch
            done_at = now + 0.005 + 0.0005 * step.batch.rows
        if step.wake_at is not None and running is None:
            wake = step.wake_at
    assert ident > 3000


def test_a_thousand_requests_in_ten_ms_are_each_answered_once_on_the_fake_clock() -> None:
    policy = calibrated()
    requests = [Request(i, 1, i * 1e-5, i * 1e-5 + 0.1) for i in range(1000)]
    admitted = {r.id for r in requests if policy.offer(r, r.arrival)}
    now, answered, expired = 0.01, set(), set()
    while True:
        step = policy.poll(now)
        expired.update(r.id for r in step.expired)
        if step.batch is None:
            if step.wake_at is None:
                break
            now = step.wake_at
            continue
        assert step.batch.rows <= 64
        answered.update(r.id for r in step.batch.requests)
        took = 0.005 + 0.0005 * step.batch.rows
        policy.complete(step.batch, now, now + took, took)
        now += took
    assert answered | expired == admitted and not answered & expired
    assert len(answered) >= 128  # 37 ms a 64-row batch: two full batches fit in 100 ms


def fitted_adaptive() -> AdaptivePolicy:
    policy = AdaptivePolicy(4, 1.0)
    policy.apply_fit(Fit(intercept_s=0.001, slope_s=0.0001, factor=1.1, samples=1))
    return policy


REFIT_HELD_S = 5.0
"""The most a held refit waits for the test to let it go: a dispatcher whose batches waited
for it would answer them only after this, once it has returned."""


class RefitFault(AdaptivePolicy):
    """Every refit job raises, or is held until the test lets it go."""

    def __init__(self, raises: bool) -> None:
        super().__init__(4, 1.0, Tuning(refit_every=1, refit_rows=1, refit_period_s=0.0))
        self.raises = raises
        self.jobs = 0
        self.entered = threading.Event()  # a refit job has begun
        self.release = threading.Event()  # the test lets a held refit go on
        self.finished = threading.Event()  # a refit job returned or raised

    def refit_job(self, now: float) -> Callable[[], Any] | None:
        job = super().refit_job(now)
        if job is None:
            return None
        self.jobs += 1

        def faulty() -> Any:
            self.entered.set()
            try:
                if self.raises:
                    raise RuntimeError("injected refit failure")
                if not self.release.wait(REFIT_HELD_S):
                    self.release.set()  # held once: any later refit goes straight on
                return job()
            finally:
                self.finished.set()

        return faulty


async def wait_until(condition: Callable[[], bool], what: str, limit_s: float = 10.0) -> None:
    """Let the loop run until `condition` holds; fail after `limit_s`."""
    give_up = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("raises", [True, False], ids=["raises", "held"])
async def test_batches_run_on_while_refits_fail_or_are_held(
    raises: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A refit that failed is logged and batches go on; one that has not come back yet (held
    until every answer is in) holds up none of them."""
    policy = RefitFault(raises)
    gate = Gate()
    d = dispatcher(gate, policy, max_batch_size=4)
    await d.start()
    try:
        first = await ask(d, rows(1))  # its batch's completion hands out the first refit
        assert not isinstance(first, Rejection), first
        assert await asyncio.to_thread(policy.entered.wait, 10), "no refit was handed out"
        if raises:  # the dispatcher has taken the failure in before the requests below
            await wait_until(lambda: "refit failed" in caplog.text, "the failure to be logged")
        answered = answered_while_held = 0
        for i in range(30):
            answer = await ask(d, rows(1, i))
            assert not isinstance(answer, Rejection), answer
            answered += 1
            answered_while_held += not policy.finished.is_set()
    finally:
        policy.release.set()
    assert answered == 30
    if not raises:
        assert answered_while_held == 30, "answers waited for the refit to come back"
    assert policy.jobs == 1  # that refit was outstanding, failed or held, for all 30


async def test_a_stalled_model_call_leaves_no_request_stranded() -> None:
    gate = Gate()
    d = dispatcher(gate, fitted_adaptive(), max_batch_size=4)
    await d.start()
    calibration = len(gate.batches)
    gate.open.clear()
    threading.Timer(0.2, gate.open.set).start()  # the model call stalls 200 ms
    answers = await asyncio.gather(*(ask(d, rows(1, i)) for i in range(40)))
    assert all(not isinstance(a, Rejection) for a in answers)
    served = gate.batches[calibration:]
    assert sum(served) == 40 and max(served) <= 4


async def test_a_clock_that_jumps_expires_what_it_must_and_serves_what_comes_after() -> None:
    offset = [0.0]
    gate = Gate()
    d = dispatcher(gate, fitted_adaptive(), max_batch_size=4)
    d.clock = lambda: time.monotonic() + offset[0]
    await d.start()
    gate.open.clear()
    held = [asyncio.ensure_future(ask(d, rows(1, i), budget=1.0)) for i in range(6)]
    await asyncio.sleep(0.05)
    offset[0] += 10.0  # the clock jumps past every queued deadline
    gate.open.set()
    answers = await asyncio.gather(*held)
    codes = [a.code if isinstance(a, Rejection) else "ok" for a in answers]
    assert "ok" in codes and FailureCode.EXPIRED in codes and len(codes) == 6
    after = await ask(d, rows(1), budget=1.0)
    assert not isinstance(after, Rejection)


async def test_an_answer_that_cannot_be_sent_strands_no_other() -> None:
    gate = Gate()
    d = dispatcher(gate, fitted_adaptive(), max_batch_size=4)
    await d.start()
    gate.open.clear()
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(4)]

    def broken(result: Tensors | Rejection, spare_s: float) -> None:
        raise OSError("the connection is gone")

    d.submit({"x": rows(1)}, 1, 10.0, broken)
    for i, future in enumerate(futures):
        d.submit({"x": rows(1, i)}, 1, 10.0,
                 lambda result, _spare_s, f=future: f.set_result(result))
    gate.open.set()
    answers = await asyncio.gather(*futures)
    assert all(not isinstance(a, Rejection) for a in answers)
    assert not isinstance(await ask(d, rows(1)), Rejection)  # and the queue moves on


STALL = """
runners:
  stall:
    model: fixture_models:gated_echo
    batching: {max_batch_size: 16, max_latency_ms: 1000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""


def test_a_live_runner_rides_out_a_stall_and_a_burst_of_a_thousand(
    serve: object, tmp_path: Path
) -> None:
    """A batch stalls in the model, held at its gate, while a burst of a thousand requests in
    ten milliseconds comes; the gate opens once the whole burst has been sent."""
    server: Server = serve(STALL)  # type: ignore[operator]
    url = f"{server.url}/v2/models/stall/infer"
    headers = {"Content-Type": "application/json"}
    held, gate = tmp_path / "held", tmp_path / "gate"
    waiting_at_release: list[int] = []  # burst requests not yet answered when the gate opened

    def body(value: float) -> bytes:
        return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                       "data": [value] * 4}]}).encode()

    def release_once_sent(progress: Progress) -> None:
        if progress.fired == progress.scheduled and not gate.exists():
            waiting_at_release.append(progress.scheduled - progress.answered)
            gate.touch()

    async def stall_then_burst() -> tuple[httpx.Response, LoadResult]:
        async with httpx.AsyncClient(timeout=30) as client:
            stalled = asyncio.create_task(client.post(url, content=body(-1.0), headers=headers))
            try:
                await wait_until(lambda: held.exists() or stalled.done(),
                                 "the stalling batch to be in the model", 30)
                assert held.exists(), stalled.result()
                burst = await run_load(url, body(1.0), headers, rate=100_000, seconds=0.01,
                                       progress=release_once_sent)
            finally:
                gate.touch()
            return await stalled, burst

    stalled, burst = asyncio.run(stall_then_burst())
    assert stalled.status_code == 200, stalled.text  # the stalled request: sent and answered
    assert stalled.json()["outputs"][0]["data"] == [-1.0] * 4
    assert waiting_at_release and waiting_at_release[0] > 0  # the burst met the stall
    assert burst.sent >= 900
    assert burst.answered == burst.sent, burst.error_fraction  # none lost, none timed out
    assert set(burst.error_fraction) <= {"503"}  # refused at once if anything, never hung
    assert burst.ok > 0
    with server.client() as client:  # serving normally right after
        assert client.post("/v2/models/stall/infer", content=body(2.0), headers=headers
                           ).status_code == 200


STALL_TIGHT = """
runners:
  stall:
    model: fixture_models:stall_echo
    batch_timeout_ms: 5000
    batching: {max_batch_size: 16, max_latency_ms: 50}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""


def test_what_a_stalled_batch_would_strand_is_refused_at_once_not_at_its_deadline(
    serve: object,
) -> None:
    server: Server = serve(STALL_TIGHT)  # type: ignore[operator]
    url = f"{server.url}/v2/models/stall/infer"
    headers = {"Content-Type": "application/json"}

    def post(value: float) -> httpx.Response:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                            "data": [value] * 4}]}
        with server.client() as client:
            return client.post(url, json=body, headers=headers)

    assert post(1.0).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(post, -2.0)  # a one-second stall in the model
        time.sleep(0.4)  # well into it: the batch has run far past its predicted time
        answers = [post(1.0) for _ in range(3)]
        assert stalled.result().status_code == 200
    # Admitted, each would have waited its 50 ms in the queue and expired there.
    for answer in answers:
        assert answer.status_code == 503
        assert "refused the request" in answer.json()["error"]  # at arrival, not expired
        # and it says what it judged on: a finish predicted past its 50 ms deadline
        judged = answer.json()
        assert judged["reason"] in ("queue", "backlog") and judged["rows_ahead"] >= 1
        assert judged["predicted_ms"] > judged["deadline_ms"] > 0
    assert post(1.0).status_code == 200  # and normal once the batch is back
