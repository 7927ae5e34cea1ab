"""Random dispatch among a runner's connected processes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from batchserve.api.dispatch import Link, Pool
from batchserve.api.errors import Unavailable
from batchserve.runner.wire import Address


class FakeTransport:
    """Only what `Link.connected` looks at: a transport that is open."""

    def is_closing(self) -> bool:
        return False


def pool_of(processes: int, connected: set[int]) -> Pool:
    pool = Pool("m", [Address.parse(f"unix:/tmp/m-{i}.sock") for i in range(processes)])
    for i in connected:
        pool.links[i].transport = FakeTransport()  # type: ignore[assignment]
    return pool


def test_picks_uniformly_among_connected_processes() -> None:
    random.seed(11)
    pool = pool_of(3, {0, 1, 2})
    picks = Counter(pool.links.index(pool.pick()) for _ in range(30_000))
    # Binomial(30000, 1/3): the standard deviation is about 82 picks, so 5 sigma is 410.
    assert all(abs(count - 10_000) < 410 for count in picks.values()), picks


def test_skips_disconnected_processes() -> None:
    pool = pool_of(3, {2})
    assert {pool.links.index(pool.pick()) for _ in range(100)} == {2}


def test_no_connected_process_is_a_503() -> None:
    with pytest.raises(Unavailable, match="no process of runner 'm' is reachable"):
        pool_of(2, set()).pick()


def test_a_link_without_transport_is_not_connected() -> None:
    assert not Link("m", Address.parse("unix:/tmp/x.sock")).connected
