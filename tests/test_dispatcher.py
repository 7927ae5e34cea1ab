"""The live dispatcher on a real event loop, with a plain numpy model and simple policies."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client import REGISTRY

from batchserve.runner.adaptive import AdaptivePolicy
from batchserve.runner.config import BatchInput, RunnerConfig, TensorSpec
from batchserve.runner.dispatcher import Dispatcher, Rejection
from batchserve.runner.metrics import RunnerMetrics
from batchserve.runner.models import Model
from batchserve.runner.policy import GreedyPolicy, Policy, Request
from batchserve.runner.types import Tensors
from batchserve.runner.wire import FailureCode

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


def dispatcher(model: Callable[..., object], policy: Policy | None = None,
               cap: int = 4) -> Dispatcher:
    runner = RunnerConfig(**{**{f: getattr(RUNNER, f) for f in RUNNER.__slots__},
                             "batching": type(RUNNER.batching)(True, cap, 1000.0)})
    return Dispatcher(runner, Model(runner, model, torch=False), policy or GreedyPolicy(cap),
                      RunnerMetrics("test-dispatcher"))


async def ask(d: Dispatcher, rows: np.ndarray, budget: float = 10.0) -> Tensors | Rejection:
    future: asyncio.Future[Tensors | Rejection] = asyncio.get_running_loop().create_future()
    d.submit({"x": rows}, budget, future.set_result)
    return await future


def rows(n: int, start: float = 0) -> np.ndarray:
    return (np.arange(n * 2, dtype=np.float32) + start).reshape(n, 2)


async def test_requests_queued_behind_a_batch_go_out_together() -> None:
    gate = Gate()
    d = dispatcher(gate)
    await d.start()
    gate.open.clear()
    first = asyncio.ensure_future(ask(d, rows(1)))
    await asyncio.sleep(0.05)  # the first batch is now held in the model
    rest = [asyncio.ensure_future(ask(d, rows(1, 10 * i))) for i in range(1, 4)]
    gate.open.set()
    answers = await asyncio.gather(first, *rest)
    for i, answer in enumerate(answers):
        assert not isinstance(answer, Rejection), answer
        np.testing.assert_array_equal(answer["y"], rows(1, 10 * i) * 2)
    assert gate.batches == [1, 3]


async def test_a_request_larger_than_the_cap_is_split_and_joined() -> None:
    gate = Gate()
    d = dispatcher(gate, cap=4)
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


async def test_a_request_whose_deadline_passes_in_the_queue_is_expired_unrun() -> None:
    gate = Gate()
    d = dispatcher(gate)
    await d.start()
    gate.open.clear()
    held = asyncio.ensure_future(ask(d, rows(1)))
    await asyncio.sleep(0.05)
    late = asyncio.ensure_future(ask(d, rows(1, 5), budget=0.01))
    await asyncio.sleep(0.05)
    gate.open.set()
    answer = await late
    assert isinstance(answer, Rejection) and answer.code == FailureCode.EXPIRED
    assert not isinstance(await held, Rejection)
    assert gate.batches == [1]


class Refuser(GreedyPolicy):
    def offer(self, request: Request, now: float) -> bool:
        return False


async def test_a_refused_request_is_answered_at_once_with_a_retry_hint() -> None:
    gate = Gate()
    d = dispatcher(gate, Refuser(4))
    await d.start()
    answer = await ask(d, rows(1))
    assert isinstance(answer, Rejection) and answer.code == FailureCode.REFUSED
    assert answer.retry_after_s > 0 and gate.batches == []


async def test_a_refused_request_counts_once_however_many_pieces_it_was_cut_into() -> None:
    def refused() -> float:
        labels = {"runner": "test-dispatcher", "reason": "refused"}
        return REGISTRY.get_sample_value("batchserve_rejections_total", labels) or 0.0

    d = dispatcher(Gate(), Refuser(4), cap=4)
    await d.start()
    before = refused()
    answer = await ask(d, rows(10))  # three pieces, each refused
    assert isinstance(answer, Rejection) and answer.code == FailureCode.REFUSED
    await ask(d, rows(1))
    assert refused() - before == 2


async def test_drain_finishes_running_work_and_stops_queued_work() -> None:
    gate = Gate()
    d = dispatcher(gate)
    await d.start()
    gate.open.clear()
    running = asyncio.ensure_future(ask(d, rows(1)))
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(ask(d, rows(1)))
    await asyncio.sleep(0.01)
    threading.Timer(0.2, gate.open.set).start()
    await d.drain(grace_s=0.1)
    stopped = await queued
    assert isinstance(stopped, Rejection) and stopped.code == FailureCode.STOPPING
    after = await ask(d, rows(1))
    assert isinstance(after, Rejection) and after.code == FailureCode.STOPPING
    running_answer = await running  # the runner is stopping: even a running batch is answered
    assert isinstance(running_answer, Rejection) and running_answer.code == FailureCode.STOPPING



async def test_the_live_gauges_show_the_calibrated_state_before_any_traffic() -> None:
    policy = AdaptivePolicy(8, 1.0)
    d = dispatcher(Gate(), policy, cap=8)
    await d.start()
    stats = policy.stats(0.0)
    value = REGISTRY.get_sample_value
    assert value("batchserve_dispatcher_batch_cap", {"runner": "test-dispatcher"}) == 8
    fitted = value("batchserve_latency_model_intercept_seconds", {"runner": "test-dispatcher"})
    assert fitted == stats.intercept_s > 0.0  # calibration timed the model: a batch costs time


async def test_a_poison_request_fails_alone_and_the_rest_of_its_batch_is_served() -> None:
    gate = Gate()
    d = dispatcher(gate, cap=8)
    await d.start()
    gate.open.clear()
    first = asyncio.ensure_future(ask(d, rows(1)))
    await asyncio.sleep(0.05)  # the first batch is held; the next six queue behind it
    poison = np.full((1, 2), np.nan, np.float32)
    queued = [asyncio.ensure_future(ask(d, poison if i == 3 else rows(1, 10 * i)))
              for i in range(6)]
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


class PerElement(GreedyPolicy):
    """Greedy, with an idle cost of 1 ms per element: what a ragged request needs is known."""

    def idle_time_s(self, rows: int) -> float:
        return rows * 0.001


async def test_a_sequence_too_long_for_the_runners_own_limit_is_413_and_not_for_a_budget(
) -> None:
    runner = RunnerConfig(
        name="sums", model="tests:sums",
        inputs=(TensorSpec("tokens", "INT64", (-1,), layout="ragged"),),
        outputs=(TensorSpec("sum", "INT64", (-1,)),),
        batching=type(RUNNER.batching)(True, 8, 100.0, max_batch_elements=1000),
        batch_inputs=(BatchInput("accumulated_element_count", "ends", "tokens"),),
    )

    def sums(tokens: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return np.add.reduceat(tokens, np.concatenate(([0], ends[:-1])))

    d = Dispatcher(runner, Model(runner, sums, torch=False), PerElement(1000),
                   RunnerMetrics("test-dispatcher-ragged"))
    await d.start()

    async def send(length: int, budget: float) -> Tensors | Rejection:
        future: asyncio.Future[Tensors | Rejection] = asyncio.get_running_loop().create_future()
        d.submit({"tokens": np.ones(length, np.int64)}, budget, future.set_result)
        return await future

    long = await send(500, 10.0)
    assert isinstance(long, Rejection) and long.code == FailureCode.TOO_LARGE
    assert long.message == (
        "500 elements need 500.0 ms on runner 'sums' even when it is idle, by its current cost "
        "model, over its max_latency_ms of 100; send at most 100 elements a request"
    )
    # 80 elements fit the runner's 100 ms even if not this request's 50 ms: never a 413.
    hurried = await send(80, 0.05)
    assert not (isinstance(hurried, Rejection) and hurried.code == FailureCode.TOO_LARGE)
    fits = await send(80, 10.0)
    assert not isinstance(fits, Rejection) and fits["sum"].tolist() == [80]
