"""Dispatch among a runner's connected processes, at random or by load."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import numpy as np
import pytest

from batchserve.api.choice import least_loaded_of_two
from batchserve.api.dispatch import Link, Pool, RunnerFailure
from batchserve.api.errors import Unavailable
from batchserve.runner.core.config import Choice
from batchserve.runner.core.wire import (
    Address,
    Call,
    Failure,
    FailureCode,
    Outbox,
    Result,
    Results,
    Started,
    batched,
    encode,
)


class FakeTransport:
    """Only what `Link.connected` looks at: a transport that is open."""

    def is_closing(self) -> bool:
        return False


def pool_of(processes: int, connected: set[int], choice: Choice = "random",
            seed: int = 11) -> Pool:
    pool = Pool("m", [Address.parse(f"unix:/tmp/m-{i}.sock") for i in range(processes)],
                choice=choice, rng=random.Random(seed))
    for i in connected:
        pool.links[i].transport = FakeTransport()  # type: ignore[assignment]
    return pool


def test_picks_uniformly_among_connected_processes() -> None:
    pool = pool_of(3, {0, 1, 2})
    picks = Counter(pool.links.index(pool.pick()) for _ in range(30_000))
    # Binomial(30000, 1/3): the standard deviation is about 82 picks, so 5 sigma is 410.
    assert all(abs(count - 10_000) < 410 for count in picks.values()), picks


def test_skips_disconnected_processes() -> None:
    pool = pool_of(3, {2})
    assert {pool.links.index(pool.pick()) for _ in range(100)} == {2}


@pytest.mark.parametrize("choice", ["random", "least_loaded_of_two"])
def test_no_connected_process_is_a_503(choice: Choice) -> None:
    with pytest.raises(Unavailable, match="no process of runner 'm' is reachable"):
        pool_of(2, set(), choice).pick()


def test_least_loaded_of_two_weighs_the_calls_in_flight_on_each_link() -> None:
    """Link 0 holds three calls, link 1 one, link 2 none (and link 3 is not connected):
    link 0 is never taken, and each pick is the one `least_loaded_of_two` makes of the
    connected links' loads with the same seed."""
    pool = pool_of(4, {0, 1, 2}, "least_loaded_of_two", seed=5)
    for link, calls in zip(pool.links, (3, 1, 0), strict=False):
        link.pending = dict.fromkeys(range(calls))  # type: ignore[arg-type]
    rng, loads = random.Random(5), [3, 1, 0]
    picks = [pool.links.index(pool.pick()) for _ in range(200)]
    assert picks == [least_loaded_of_two(3, loads.__getitem__, rng) for _ in range(200)]
    assert set(picks) == {1, 2}
    assert pool.links.index(pool.pick(besides=pool.links[2])) == 1


def test_a_link_without_transport_is_not_connected() -> None:
    assert not Link("m", Address.parse("unix:/tmp/x.sock")).connected


class WritingTransport(FakeTransport):
    """An open transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def writelines(self, chunks: list[bytes | memoryview]) -> None:
        self.written.append(b"".join(bytes(chunk) for chunk in chunks))


def connected_link(name: str = "unix:/tmp/m.sock") -> tuple[Link, WritingTransport]:
    link = Link("m", Address.parse(name))
    transport = WritingTransport()
    link.transport = transport  # type: ignore[assignment]
    link.outbox = Outbox(transport)  # type: ignore[arg-type]
    return link, transport


def hear(link: Link, message: Result | Results | Failure | Started) -> None:
    """The runner's frame arriving on the link's connection."""
    data = b"".join(bytes(chunk) for chunk in encode(message))
    buffer = link.get_buffer(len(data))
    buffer[: len(data)] = data
    link.buffer_updated(len(data))


def test_a_runner_silent_past_a_calls_deadline_gets_a_503_and_leaves_no_timer() -> None:
    async def scenario() -> list[object]:
        link, transport = connected_link()
        outcomes: list[object] = []
        given_up = asyncio.Event()

        def first(outcome: object) -> None:
            outcomes.append(outcome)
            given_up.set()

        sent = asyncio.get_running_loop().time()
        link.send(lambda ident: Call(ident, 0.05, 1, {}), first, time.monotonic() + 0.05)
        link.send(lambda ident: Call(ident, 5.0, 1, {}), outcomes.append, time.monotonic() + 5)
        await asyncio.sleep(0)
        assert len(transport.written) == 1  # both calls in one write
        await asyncio.wait_for(given_up.wait(), 5)
        waited = asyncio.get_running_loop().time() - sent
        assert 0.05 <= waited < 1.0
        assert link._expiry is not None  # armed for the call still waiting
        hear(link, Result(2, {}, 0.0))
        assert link._expiry is None and not link.pending
        return outcomes

    first, second = asyncio.run(scenario())
    assert isinstance(first, Unavailable)
    assert str(first) == "runner 'm' did not answer in time"
    assert second == Result(2, {}, 0.0)


def two_linked() -> Pool:
    pool = Pool("m", [Address.parse(f"unix:/tmp/m-{i}.sock") for i in range(2)])
    for link in pool.links:
        link.transport = WritingTransport()  # type: ignore[assignment]
        link.outbox = Outbox(link.transport)  # type: ignore[arg-type]
    return pool


def test_a_caller_is_told_how_long_before_its_deadline_the_runners_batch_ended() -> None:
    async def scenario() -> list[tuple[object, float]]:
        pool, told = two_linked(), []
        for _ in range(2):
            pool.submit({}, 1, 5.0, (), 1.0, lambda outcome, spare_s: told.append(
                (outcome, spare_s)))
        calls = [(link, ident) for link in pool.links for ident in list(link.pending)]
        (link, ident), (other, refused) = calls
        hear(link, Result(ident, {"y": np.ones(1)}, 0.0125))
        hear(other, Failure(refused, FailureCode.REFUSED, "too late", 0.5))
        return told

    (answer, spare_s), (failure, no_spare_s) = asyncio.run(scenario())
    assert list(answer) == ["y"] and spare_s == 0.0125  # type: ignore[call-overload]
    assert isinstance(failure, RunnerFailure) and no_spare_s == 0.0


def test_a_batchs_answers_in_one_frame_reach_each_caller_with_its_rows_and_spare() -> None:
    async def scenario() -> tuple[list[tuple[int, object, float]], Link]:
        link, _ = connected_link()
        told: list[tuple[int, object, float]] = []
        for index in range(3):
            link.send(lambda ident: Call(ident, 5.0, 1, {}),
                      lambda outcome, i=index: told.append((i, outcome, -1.0)),
                      time.monotonic() + 5)
        first, second, third = list(link.pending)
        answers = [Result(ident, {"y": np.full((rows, 2), ident, np.float32)}, spare)
                   for ident, rows, spare in ((third, 1, 0.03), (first, 2, 0.01),
                                              (second, 1, 0.02))]
        (frame,) = batched(answers, 0)
        hear(link, frame)  # type: ignore[arg-type]
        return told, link

    told, link = asyncio.run(scenario())
    assert not link.pending and link._expiry is None
    by_caller = {index: outcome for index, outcome, _ in told}
    assert sorted(by_caller) == [0, 1, 2]
    for index, outcome in by_caller.items():
        assert isinstance(outcome, Result)
        assert outcome.tensors["y"].shape == ((2, 2) if index == 0 else (1, 2))
        assert (outcome.tensors["y"] == outcome.id).all()  # its own rows, not a neighbour's
    assert [by_caller[i].spare_s for i in range(3)] == [0.01, 0.02, 0.03]  # type: ignore[attr-defined]


@pytest.mark.parametrize("started", [False, True])
def test_a_call_no_process_started_goes_once_to_another_and_a_started_one_never(
    started: bool,
) -> None:
    async def scenario() -> list[object]:
        pool, outcomes = two_linked(), []
        pool.submit({}, 1, 5.0, (), 1.0, lambda outcome, _spare_s: outcomes.append(outcome))
        first = next(link for link in pool.links if link.pending)
        other = next(link for link in pool.links if link is not first)
        (ident,) = first.pending
        if started:
            hear(first, Started((ident,)))
        first.connection_lost(None)
        if not started:
            assert not outcomes and len(other.pending) == 1  # sent on at once
            hear(other, Result(next(iter(other.pending)), {"y": np.ones(1)}, 0.0))
        return outcomes

    (outcome,) = asyncio.run(scenario())
    if started:
        assert isinstance(outcome, Unavailable)
        assert "went away while running the request" in str(outcome)
    else:
        assert list(outcome) == ["y"]  # type: ignore[call-overload]
