"""The example models' table: predicted against observed batch time by size, and the plan's
check against a live sweep (benchmarks/model_fit.py, benchmarks/model_table.py), pure parts."""

from __future__ import annotations

import pytest

from batchserve.api.bench.load_result import summarize
from benchmarks.model_fit import Logged, bucket, by_size, markdown, parse
from benchmarks.model_table import Run, knee, within

LOG = """rows,wall_s,cpu_s,predicted_s
1,0.030,0.020,0.040
1,0.050,0.020,0.040
3,0.090,0.060,0.060
4,0.100,0.070,0.080
5,0.200,0.100,0.100
"""


def test_a_log_reads_as_batches_with_their_predictions() -> None:
    assert parse(LOG.splitlines()) == [
        Logged(1, 0.030, 0.040), Logged(1, 0.050, 0.040), Logged(3, 0.090, 0.060),
        Logged(4, 0.100, 0.080), Logged(5, 0.200, 0.100)]


def test_a_line_without_a_prediction_is_left_out() -> None:
    assert parse(["rows,wall_s,cpu_s", "1,0.030,0.020", "2,0.040,0.030,0"]) == []


@pytest.mark.parametrize(("size", "sizes"), [
    (1, (1, 1)), (2, (2, 2)), (3, (3, 4)), (4, (3, 4)), (5, (5, 8)), (8, (5, 8)),
    (9, (9, 16)), (32, (17, 32)),
])
def test_sizes_fall_in_buckets_that_double(size: int, sizes: tuple[int, int]) -> None:
    assert bucket(size) == sizes


def test_each_bucket_sets_observed_beside_predicted() -> None:
    one, few, more = by_size("m", parse(LOG.splitlines()))
    assert (one.sizes, one.batches, one.p50_ms, one.p99_ms) == ((1, 1), 2, 50.0, 50.0)
    assert one.predicted_ms == pytest.approx(40.0)
    assert one.ratio_p99 == pytest.approx(1.25) and one.holds
    assert (few.sizes, few.batches, few.p99_ms, few.predicted_ms) == ((3, 4), 2, 100.0, 80.0)
    assert few.ratio_p99 == pytest.approx(1.5) and few.holds
    assert more.ratio_p99 == pytest.approx(2.0) and not more.holds
    assert "| m | 5-8 | 1 | 200.0 | 200.0 | 100.0 | 2.00 | 2.00 | **no** |" in markdown(
        [one, few, more])


def test_sizes_count_requests_when_a_request_is_a_sequence_of_unit_rows() -> None:
    batches = [Logged(64, 0.01, 0.01), Logged(128, 0.02, 0.02), Logged(320, 0.05, 0.05)]
    assert [row.sizes for row in by_size("encoder", batches, unit=64)] == [
        (1, 1), (2, 2), (5, 8)]


def run(rate: float, ok: int, p99_ms: float, sent: int = 100) -> Run:
    latencies = [p99_ms / 1000.0] * sent
    statuses = [200] * ok + [503] * (sent - ok)
    return Run(rate, summarize(rate, 10.0, latencies, statuses, [0.0] * sent, 10.0, (1, 0),
                               0.0, slo_ms=300.0), 300.0)


def test_a_run_passes_with_at_most_one_percent_refused_and_p99_within_the_limit() -> None:
    assert run(10, 99, 290).passed
    assert not run(10, 98, 290).passed
    assert not run(10, 100, 310).passed


def test_the_knee_is_the_highest_rate_passed_below_the_first_that_failed() -> None:
    runs = [run(5, 100, 100), run(7, 100, 200), run(9, 100, 400), run(11, 100, 250)]
    assert knee(runs) == 7
    assert knee([run(5, 90, 100)]) is None


def test_a_rate_passes_when_most_of_its_runs_do() -> None:
    runs = [run(5, 100, 100), run(7, 100, 200), run(7, 100, 250), run(7, 100, 400),
            run(9, 100, 400), run(9, 100, 350), run(9, 100, 200)]
    assert knee(runs) == 7


def test_within_a_quarter_either_way() -> None:
    assert within(12.5, 10.0) and within(7.5, 10.0)
    assert not within(12.6, 10.0) and not within(7.4, 10.0) and not within(5.0, None)
