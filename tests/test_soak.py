"""A minute's soak at about 80% of capacity: every request answered, memory flat."""

from __future__ import annotations

import asyncio

import pytest

from batchserve.api.bench.loadgen import loop_factory
from benchmarks.soak import Soak, soak
from tests.conftest import ROOT, start_server


@pytest.mark.timeout(180)
def test_a_minute_at_eighty_percent_loses_nothing_and_grows_no_memory() -> None:
    server = start_server(ROOT / "configuration.yml", "--api-workers", "2")
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            result = soak(server.url, server.pid, rate=1900, seconds=60, window=10,
                          runner=runner)
    finally:
        assert server.stop() == 0
    assert result.sent > 100_000
    assert result.answered == result.sent, result.report()  # exactly one answer each
    growth = result.growth()
    assert len(growth) == 8, result.report()  # supervisor, 5 runners, 2 API workers
    assert max(growth.values()) < 0.05, result.report()


def test_the_soak_report_says_what_failed() -> None:
    bad = Soak(100, 60, sent=10, answered=9, ok=9, window_p99_ms=[5.0],
               rss_start_kib={1: 1000}, rss_end_kib={1: 1100})
    assert "every request answered once: NO" in bad.report()
    assert "RSS growth, worst process: 10.00% (under 5%: NO)" in bad.report()
