"""Dispatch among a runner's connected processes, at random or by load."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from batchserve.api.choice import least_loaded_of_two
from batchserve.api.dispatch import Link, Pool
from batchserve.api.errors import Unavailable
from batchserve.runner.core.config import Choice
from batchserve.runner.core.wire import Address


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
