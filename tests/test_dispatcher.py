"""The live dispatcher on a real event loop, with a plain numpy model and simple policies."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client import REGISTRY

from batchserve.runner.core.config import BatchInput, RunnerConfig, TensorSpec
from batchserve.runner.core.timeouts import Timeouts
from batchserve.runner.core.types import Tensors
from batchserve.runner.core.wire import FailureCode
from batchserve.runner.dispatcher import Dispatcher, Rejection, Reply
from batchserve.runner.metrics import RunnerMetrics
from batchserve.runner.models import Model
from batchserve.runner.policy.adaptive import AdaptivePolicy
from batchserve.runner.policy.base import GreedyPolicy, Policy, Refusal, Request

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


RUNNER = RunnerConfig(
    name="double",
    model="tests:double",
    inputs=(TensorSpec("x", "FP32", (-1, 2)),),
    outputs=(TensorSpec("y", "FP32", (-1, 2)),),
)


class Gate:
    """A model that doubles its input and records batch sizes; it can be held shut."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.batches: list[int] = []

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.open.wait(10)
        self.batches.append(x.shape[0])
        if np.isnan(x).any():
            raise ValueError("NaN in the batch")
        return x * 2


class FakeClock:
    """Time that moves only when a test moves it: the dispatcher's clock and its event loop's,
    so the policy's wake-ups, deadlines and the drain's grace period are all exact."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    async def advance(self, seconds: float) -> None:
        """Let what is ready run, move time on, and let what came due run."""
        await asyncio.sleep(0)
        self.now += seconds
        await asyncio.sleep(0)


def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """A fake clock that the running event loop keeps time by too."""
    loop = asyncio.get_running_loop()
    clock = FakeClock(loop.time())
    monkeypatch.setattr(loop, "time", clock)
    return clock


def dispatcher(model: Callable[..., object], policy: Policy | None = None,
               max_batch_size: int = 4, clock: Callable[[], float] = time.monotonic
               ) -> Dispatcher:
    batching = type(RUNNER.batching)(True, max_batch_size, 1000.0)
    runner = RunnerConfig(**{**{f: getattr(RUNNER, f) for f in RUNNER.__slots__},
                             "batching": batching})
    return Dispatcher(runner, Model(runner, model, torch=False),
                      policy or GreedyPolicy(max_batch_size), RunnerMetrics("test-dispatcher"),
                      clock=clock)


async def gated(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeClock, Gate, Dispatcher]:
    """A started dispatcher on a fake clock, its model a gate."""
    clock = fake_clock(monkeypatch)
    gate = Gate()
    d = dispatcher(gate, clock=clock)
    await d.start()
    return clock, gate, d


def settle(future: asyncio.Future[Tensors | Rejection]) -> Reply:
    """A reply that puts the answer in `future`, the spare time aside."""
    return lambda result, _spare_s: future.set_result(result)


def send(d: Dispatcher, x: np.ndarray, budget: float = 10.0,
         started: Callable[[], None] | None = None, spent: float = 0.0
         ) -> asyncio.Future[Tensors | Rejection]:
    """Submit `x` now; the future holds its one answer."""
    future: asyncio.Future[Tensors | Rejection] = asyncio.get_running_loop().create_future()
    d.submit({"x": x}, len(x), budget, settle(future), started, spent_s=spent)
    return future


async def ask(d: Dispatcher, x: np.ndarray, budget: float = 10.0, spent: float = 0.0
              ) -> Tensors | Rejection:
    return await send(d, x, budget, spent=spent)


async def hold(d: Dispatcher, gate: Gate, x: np.ndarray) -> asyncio.Future[Tensors | Rejection]:
    """Shut the gate and submit `x`; return once its batch has gone to the model."""
    gate.open.clear()
    in_model = asyncio.Event()
    answer = send(d, x, started=in_model.set)
    await in_model.wait()
    return answer


async def completion(d: Dispatcher, limit_s: float = 10.0) -> None:
    """Wait, in real time, until the running batch's completion has run on the loop."""
    give_up = time.monotonic() + limit_s
    while d.busy and time.monotonic() < give_up:
        await asyncio.to_thread(time.sleep, 0.001)  # real time; the fake clock stands still
    assert not d.busy, "the model call did not come back"
    await asyncio.sleep(0)


def rows(n: int, start: float = 0) -> np.ndarray:
    return (np.arange(n * 2, dtype=np.float32) + start).reshape(n, 2)


async def test_requests_queued_behind_a_batch_go_out_together() -> None:
    gate = Gate()
    d = dispatcher(gate)
    await d.start()
    first = await hold(d, gate, rows(1))
    rest = [send(d, rows(1, 10 * i)) for i in range(1, 4)]
    gate.open.set()
    answers = await asyncio.gather(first, *rest)
    for i, answer in enumerate(answers):
        assert not isinstance(answer, Rejection), answer
        np.testing.assert_array_equal(answer["y"], rows(1, 10 * i) * 2)
    assert gate.batches == [1, 3]


async def test_a_request_larger_than_max_batch_size_is_split_and_joined() -> None:
    gate = Gate()
    d = dispatcher(gate, max_batch_size=4)
    await d.start()
    answer = await ask(d, rows(10))
    assert not isinstance(answer, Rejection)
    np.testing.assert_array_equal(answer["y"], rows(10) * 2)
    assert gate.batches == [4, 4, 2] and max(gate.batches) <= 4


async def test_a_failing_batch_answers_each_request_and_the_next_batch_runs() -> None:
    d = dispatcher(Gate())
    await d.start()
    failed = await ask(d, np.full((1, 2), np.nan, np.float32))
    assert isinstance(failed, Rejection) and failed.code == FailureCode.MODEL_ERROR
    assert failed.message == "the model failed: ValueError: NaN in the batch"
    ok = await ask(d, rows(2))
    assert not isinstance(ok, Rejection)


async def test_a_request_whose_deadline_passes_in_the_queue_is_expired_unrun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock, gate, d = await gated(monkeypatch)
    held = await hold(d, gate, rows(1))
    late = send(d, rows(1, 5), budget=0.01)
    on_time = send(d, rows(1, 7), budget=0.02)
    await clock.advance(0.015)  # past the first's deadline, not the second's
    gate.open.set()
    answer = await late
    assert isinstance(answer, Rejection) and answer.code == FailureCode.EXPIRED
    assert answer.message == "the request's deadline passed while queued for 'double'"
    assert not isinstance(await held, Rejection)
    assert not isinstance(await on_time, Rejection)
    assert gate.batches == [1, 1]


async def test_each_answer_says_how_long_before_its_deadline_its_batch_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = fake_clock(monkeypatch)

    def model(x: np.ndarray) -> np.ndarray:  # 30 ms a batch, on the fake clock
        clock.now += 0.030
        return x * 2

    d = dispatcher(model, clock=clock, max_batch_size=4)
    await d.start()

    async def spare(x: np.ndarray, budget: float) -> float:
        told: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        d.submit({"x": x}, len(x), budget, lambda _result, spare_s: told.set_result(spare_s))
        return await told

    assert await spare(rows(1), 0.100) == pytest.approx(0.070)
    assert await spare(rows(1), 0.010) == pytest.approx(-0.020)  # it ended 20 ms late
    # Cut in two pieces (4 rows, then 2), one batch each: it ends with the second.
    assert await spare(rows(6), 0.100) == pytest.approx(0.040)


class Refuser(GreedyPolicy):
    def offer(self, request: Request, now: float) -> bool:
        self.why = Refusal(now + 0.5, 7, 3.0)
        return False

    def refusal(self) -> Refusal | None:
        return self.why


async def test_a_refused_request_is_answered_at_once_with_a_retry_hint() -> None:
    gate = Gate()
    d = dispatcher(gate, Refuser(4))
    await d.start()
    answer = await ask(d, rows(1))
    assert isinstance(answer, Rejection) and answer.code == FailureCode.REFUSED
    assert answer.retry_after_s == 3.0 and gate.batches == []  # the policy's own
    # What the policy judged on, relative to the arrival: its predicted end, the deadline.
    assert answer.predicted_s == pytest.approx(0.5) and answer.rows_ahead == 7
    assert 0 < answer.deadline_s <= d.max_latency_s


async def test_a_refused_request_counts_once_however_many_pieces_it_was_cut_into() -> None:
    def refused() -> float:
        labels = {"runner": "test-dispatcher", "reason": "queue"}
        return REGISTRY.get_sample_value("batchserve_rejections_total", labels) or 0.0

    d = dispatcher(Gate(), Refuser(4), max_batch_size=4)
    await d.start()
    before = refused()
    answer = await ask(d, rows(10))  # three pieces, each refused
    assert isinstance(answer, Rejection) and answer.code == FailureCode.REFUSED
    await ask(d, rows(1))
    assert refused() - before == 2


async def test_drain_waits_its_grace_period_then_stops_what_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock, gate, d = await gated(monkeypatch)
    running = await hold(d, gate, rows(1))
    queued = send(d, rows(1))
    draining = asyncio.ensure_future(d.drain(grace_s=0.1))
    await clock.advance(0.099)
    assert not draining.done() and not queued.done()  # within the grace period: waiting
    await clock.advance(0.001)
    await draining
    stopped = await queued
    assert isinstance(stopped, Rejection) and stopped.code == FailureCode.STOPPING
    after = await ask(d, rows(1))
    assert isinstance(after, Rejection) and after.code == FailureCode.STOPPING
    running_answer = await running  # the runner is stopping: even a running batch is answered
    assert isinstance(running_answer, Rejection) and running_answer.code == FailureCode.STOPPING
    gate.open.set()  # the model call that outlived the drain ends; its answer goes nowhere
    await completion(d)
    assert gate.batches == [1]  # the queued request, answered already, never ran


async def test_drain_returns_as_soon_as_the_running_work_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock, gate, d = await gated(monkeypatch)
    running = await hold(d, gate, rows(1))
    queued = send(d, rows(1, 3))
    draining = asyncio.ensure_future(d.drain(grace_s=0.1))
    await clock.advance(0.05)
    gate.open.set()  # both batches finish within the grace period, the clock standing still
    await draining
    for answer, x in ((await running, rows(1)), (await queued, rows(1, 3))):
        assert not isinstance(answer, Rejection), answer
        np.testing.assert_array_equal(answer["y"], x * 2)
    assert gate.batches == [1, 1]



async def test_the_live_gauges_show_the_calibrated_state_before_any_traffic() -> None:
    policy = AdaptivePolicy(8, 1.0)
    d = dispatcher(Gate(), policy, max_batch_size=8)
    await d.start()
    stats = policy.stats(0.0)
    value = REGISTRY.get_sample_value
    assert value("batchserve_dispatcher_batch_cap", {"runner": "test-dispatcher"}) == 8
    fitted = value("batchserve_latency_model_intercept_seconds", {"runner": "test-dispatcher"})
    assert fitted == stats.intercept_s > 0.0  # calibration timed the model: a batch costs time


async def test_a_poison_request_fails_alone_and_the_rest_of_its_batch_is_served() -> None:
    gate = Gate()
    d = dispatcher(gate, max_batch_size=8)
    await d.start()
    first = await hold(d, gate, rows(1))  # the next six queue behind it
    poison = np.full((1, 2), np.nan, np.float32)
    queued = [send(d, poison if i == 3 else rows(1, 10 * i)) for i in range(6)]
    gate.open.set()
    await first
    answers = await asyncio.gather(*queued)
    for i, answer in enumerate(answers):
        if i == 3:
            assert isinstance(answer, Rejection) and answer.code == FailureCode.MODEL_ERROR
            assert answer.message == "the model failed: ValueError: NaN in the batch"
        else:
            assert not isinstance(answer, Rejection), answer
            np.testing.assert_array_equal(answer["y"], rows(1, 10 * i) * 2)
    assert not isinstance(await ask(d, rows(2)), Rejection)  # and the runner serves on


class TenthOfASecondARow(GreedyPolicy):
    """A greedy policy whose cost curve says each row takes 0.1 s on an idle model."""

    def idle_time_s(self, rows: int) -> float:
        return 0.1 * rows


async def test_too_large_is_judged_against_the_runners_own_limit_not_the_budget_left() -> None:
    """5 rows need 0.5 s: over a 0.2 s budget but within max_latency_ms 1000, so they are
    queued; 20 rows need 2 s, which no idle model meets: a 413's TOO_LARGE with advice."""
    d = dispatcher(Gate(), TenthOfASecondARow(4))
    await d.start()
    fits = await ask(d, rows(5), budget=0.2)
    assert not isinstance(fits, Rejection) or fits.code != FailureCode.TOO_LARGE, fits
    refused = await ask(d, rows(20), budget=10.0)
    assert isinstance(refused, Rejection) and refused.code == FailureCode.TOO_LARGE
    assert refused.message.endswith(
        "over its max_latency_ms of 1000; send at most 10 rows a request"
    ), refused.message


async def test_what_decoding_cost_counts_against_the_limit_with_the_model() -> None:
    """5 rows need 0.5 s of model, within the 1 s limit alone; with 0.6 s spent decoding
    them no idle model meets it. The most that fit decode in proportion: 0.22 s a row."""
    d = dispatcher(Gate(), TenthOfASecondARow(4))
    await d.start()
    refused = await ask(d, rows(5), spent=0.6)
    assert isinstance(refused, Rejection) and refused.code == FailureCode.TOO_LARGE
    assert refused.message == (
        "5 rows need 1100.0 ms (600.0 ms of it to decode them) on runner 'double' even when "
        "it is idle, by its current cost model, over its max_latency_ms of 1000; send at "
        "most 4 rows a request")
    served = await ask(d, rows(5), spent=0.4)
    assert not isinstance(served, Rejection), served


class RefusesWhenQueued(GreedyPolicy):
    """Greedy, but refuses whatever arrives while anything is queued or running, unless the
    dispatcher assured it: what a reserve on later pieces does to a request cut in pieces."""

    def offer(self, request: Request, now: float) -> bool:
        if (self.queue or self.busy) and not request.assured:
            return False
        return super().offer(request, now)


async def test_a_request_in_pieces_that_fits_an_idle_model_is_taken_whole() -> None:
    """10 rows in pieces of 4 on an idle model: every piece is admitted, though the policy
    refuses unassured arrivals while busy; behind a running batch the same request is
    refused for now (503), not as too large."""
    gate = Gate()
    d = dispatcher(gate, RefusesWhenQueued(4))
    await d.start()
    whole = await ask(d, rows(10))
    assert not isinstance(whole, Rejection), whole
    assert whole["y"].tolist() == (rows(10) * 2).tolist()
    assert sorted(gate.batches) == [2, 4, 4]
    running = await hold(d, gate, rows(1))
    busy = await ask(d, rows(10))
    assert isinstance(busy, Rejection) and busy.code == FailureCode.REFUSED
    gate.open.set()
    assert not isinstance(await running, Rejection)


class Turnstile:
    """A model that doubles its input and lets one call through per `admit`."""

    def __init__(self) -> None:
        self.turn = threading.Semaphore(0)
        self.calls = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        assert self.turn.acquire(timeout=10)
        return x * 2

    async def admit(self, calls: int) -> None:
        """Let one call through, then wait in real time until the model has been called
        `calls` times in all."""
        self.turn.release()
        give_up = time.monotonic() + 10
        while self.calls < calls and time.monotonic() < give_up:
            await asyncio.to_thread(time.sleep, 0.001)
        assert self.calls >= calls


async def test_a_request_in_pieces_the_idle_model_runs_too_slowly_is_too_large(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Assured on an idle model, 10 rows in pieces of 4 run past their 10 ms deadline: the
    last piece expires in the queue. A 503 would have the client retry into the same
    slowness; it is a 413, with the 4 rows answered in time as the advice."""
    clock = fake_clock(monkeypatch)
    model = Turnstile()
    d = dispatcher(model, clock=clock)
    await d.start()
    whole = send(d, rows(10), budget=0.01)
    await clock.advance(0.005)
    await model.admit(calls=2)  # the first piece in time, the second now in the model
    await clock.advance(0.01)
    await model.admit(calls=2)  # the second piece late; the third expires unrun
    answer = await whole
    assert isinstance(answer, Rejection) and answer.code == FailureCode.TOO_LARGE
    assert answer.message == (
        "10 rows did not finish by the request's deadline on runner 'double' even when it "
        "is idle: its pieces ran slower than its cost model said; send at most 4 rows a "
        "request")
    assert model.calls == 2
    served = send(d, rows(1))
    await model.admit(calls=3)
    assert not isinstance(await served, Rejection)


async def test_a_piece_that_expires_behind_other_traffic_is_503() -> None:
    """The same 10 rows behind a running batch were not assured: a piece that expires there
    is refused for now (503), to come back, not as too large."""
    gate = Gate()
    d = dispatcher(gate)
    await d.start()
    running = await hold(d, gate, rows(1))
    whole = send(d, rows(10), budget=0.01)
    await asyncio.sleep(0.02)
    gate.open.set()
    answer = await whole
    assert isinstance(answer, Rejection) and answer.code == FailureCode.EXPIRED
    assert not isinstance(await running, Rejection)


class PerElement(GreedyPolicy):
    """Greedy, with an idle cost of 1 ms per element: what a ragged request needs is known."""

    def idle_time_s(self, rows: int) -> float:
        return rows * 0.001


SUMS = RunnerConfig(
    name="sums", model="tests:sums",
    inputs=(TensorSpec("tokens", "INT64", (-1,), layout="ragged"),),
    outputs=(TensorSpec("sum", "INT64", (-1,)),),
    batching=type(RUNNER.batching)(True, 8, 100.0, max_batch_elements=1000),
    batch_inputs=(BatchInput("accumulated_element_count", "ends", "tokens"),),
)


class Sums:
    """Each request's sum from a ragged batch; records each batch's tokens, held if shut."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.batches: list[int] = []

    def __call__(self, tokens: np.ndarray, ends: np.ndarray) -> np.ndarray:
        self.open.wait(10)
        self.batches.append(tokens.size)
        return np.add.reduceat(tokens, np.concatenate(([0], ends[:-1])))


def sums_dispatcher(policy: Policy, model: Sums | None = None) -> Dispatcher:
    return Dispatcher(SUMS, Model(SUMS, model or Sums(), torch=False), policy,
                      RunnerMetrics("test-dispatcher-ragged"))


def send_sequence(d: Dispatcher, length: int, budget: float = 10.0,
                  started: Callable[[], None] | None = None, spent: float = 0.0
                  ) -> asyncio.Future[Tensors | Rejection]:
    """Submit one ragged request of `length` ones: one row."""
    future: asyncio.Future[Tensors | Rejection] = asyncio.get_running_loop().create_future()
    d.submit({"tokens": np.ones(length, np.int64)}, 1, budget, settle(future), started,
             spent_s=spent)
    return future


async def test_a_sequence_too_long_for_the_runners_own_limit_is_413_and_not_for_a_budget(
) -> None:
    d = sums_dispatcher(PerElement(1000))
    await d.start()
    long = await send_sequence(d, 500)
    assert isinstance(long, Rejection) and long.code == FailureCode.TOO_LARGE
    assert long.message == (
        "500 elements need 500.0 ms on runner 'sums' even when it is idle, by its current cost "
        "model, over its max_latency_ms of 100; send at most 100 elements a request"
    )
    # 80 elements fit the runner's 100 ms even if not this request's 50 ms: never a 413.
    hurried = await send_sequence(d, 80, budget=0.05)
    assert not (isinstance(hurried, Rejection) and hurried.code == FailureCode.TOO_LARGE)
    fits = await send_sequence(d, 80)
    assert not isinstance(fits, Rejection) and fits["sum"].tolist() == [80]


async def test_decoding_counts_against_the_limit_in_elements_too() -> None:
    """80 elements need 80 ms of model; with 30 ms of decoding, 110 ms: over the 100 ms
    limit. Decoding at 0.375 ms an element, 72 elements fit."""
    d = sums_dispatcher(PerElement(1000))
    await d.start()
    refused = await send_sequence(d, 80, spent=0.03)
    assert isinstance(refused, Rejection) and refused.code == FailureCode.TOO_LARGE
    assert refused.message == (
        "80 elements need 110.0 ms (30.0 ms of it to decode them) on runner 'sums' even when "
        "it is idle, by its current cost model, over its max_latency_ms of 100; send at most "
        "72 elements a request")
    fits = await send_sequence(d, 72, spent=0.027)
    assert not isinstance(fits, Rejection) and fits["sum"].tolist() == [72]


async def test_a_sequence_over_max_batch_elements_is_never_cut_but_refused() -> None:
    """The signature refuses these before the dispatcher; one that comes anyway is INVALID,
    not cut into pieces as rows would be (and not a 413: no wait or split could help)."""
    model = Sums()
    d = sums_dispatcher(GreedyPolicy(1000), model)
    await d.start()
    refused = await send_sequence(d, 1001)
    assert refused == Rejection(FailureCode.INVALID, (
        "the request has 1001 elements; runner 'sums' takes at most 1000 in a batch "
        "(its max_batch_elements)"
    ))
    assert model.batches == []


async def test_batches_of_sequences_are_bounded_in_elements_and_answered_a_row_each() -> None:
    """The policy weighs each request by its elements (1000 at most in a batch), and each
    request gets its one row of the outputs back."""
    model = Sums()
    d = sums_dispatcher(GreedyPolicy(1000), model)
    await d.start()
    model.open.clear()
    in_model = asyncio.Event()
    first = send_sequence(d, 10, started=in_model.set)
    await in_model.wait()
    queued = [send_sequence(d, length) for length in (600, 300, 200, 5)]
    model.open.set()
    answers = await asyncio.gather(first, *queued)
    assert [answer["sum"].tolist() for answer in answers
            if not isinstance(answer, Rejection)] == [[10], [600], [300], [200], [5]]
    assert model.batches == [10, 900, 205]


class Incoming:
    """A connection the dispatcher holds, on which a call may be coming in."""

    def __init__(self) -> None:
        self.partial = False
        self.resumed = 0

    def resume(self) -> None:
        self.resumed += 1


async def test_the_next_batch_waits_for_a_call_still_coming_in_not_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A call larger than the socket's buffer takes several reads. Polled as soon as the model
    # came free, the queued request would go alone and the call wait for the whole batch
    # after it: three batches of one, where two make a batch of two.
    clock, gate, d = await gated(monkeypatch)
    connection = Incoming()
    first = await hold(d, gate, rows(1))
    assert d.hold(connection)  # the model runs: the connection waits unread
    queued = send(d, rows(1, 10))
    connection.partial = True  # a large call's first bytes are in, the rest on their way
    gate.open.set()
    await completion(d)
    assert connection.resumed == 1 and isinstance(await first, dict)
    assert gate.batches == [1]  # the poll waits for the call ...
    connection.partial = False
    call = send(d, rows(1, 20))  # ... which comes in whole and is offered
    assert isinstance(await queued, dict) and isinstance(await call, dict)
    assert gate.batches == [1, 2]

    # A call that does not come in holds the next batch for `Timeouts.FRAME_WAIT_S` only.
    running = await hold(d, gate, rows(1, 30))
    assert d.hold(connection)
    late = send(d, rows(1, 40))
    connection.partial = True
    gate.open.set()
    await completion(d)
    assert gate.batches == [1, 2, 1]
    await clock.advance(Timeouts.FRAME_WAIT_S)
    assert isinstance(await running, dict) and isinstance(await late, dict)
    assert gate.batches == [1, 2, 1, 1]
