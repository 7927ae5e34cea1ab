"""Readings of /metrics, their differences and PromQL-style quantiles
(batchserve.api.bench.scrape)."""

from __future__ import annotations

import math

import pytest

from batchserve.api.bench.scrape import Scrape, bucket_delta, delta, histogram_quantile

TEXT = """\
# HELP batchserve_batch_time_ratio ratio
# TYPE batchserve_batch_time_ratio histogram
batchserve_batch_time_ratio_bucket{le="0.5",runner="mlp"} 10.0
batchserve_batch_time_ratio_bucket{le="1.0",runner="mlp"} 90.0
batchserve_batch_time_ratio_bucket{le="2.0",runner="mlp"} 100.0
batchserve_batch_time_ratio_bucket{le="+Inf",runner="mlp"} 100.0
batchserve_batch_time_ratio_count{runner="mlp"} 100.0
batchserve_batch_time_ratio_sum{runner="mlp"} 80.0
# HELP batchserve_requests_total answered
# TYPE batchserve_requests_total counter
batchserve_requests_total{code="200",runner="mlp"} 7.0
batchserve_requests_total{code="503",runner="mlp"} 2.0
batchserve_requests_total{code="200",runner="iris_clf"} 5.0
"""
INF = math.inf


def test_a_reading_sums_and_splits_by_label() -> None:
    scrape = Scrape.parse(TEXT)
    assert scrape.total("batchserve_requests_total", runner="mlp") == 9
    assert scrape.by_label("batchserve_requests_total", "code", runner="mlp") == {
        "200": 7, "503": 2}
    assert scrape.buckets("batchserve_batch_time_ratio", runner="mlp") == {
        0.5: 10, 1.0: 90, 2.0: 100, INF: 100}
    assert scrape.total("batchserve_batch_time_ratio_sum", runner="mlp") == 80


def test_deltas_keep_what_changed() -> None:
    assert delta({"200": 7, "503": 2}, {"200": 10, "503": 2, "504": 1}) == {"200": 3, "504": 1}
    assert bucket_delta({1.0: 2, INF: 3}, {1.0: 5, INF: 9}) == {1.0: 3, INF: 6}


def test_quantiles_interpolate_inside_a_bucket_like_promql() -> None:
    buckets = {0.5: 10.0, 1.0: 90.0, 2.0: 100.0, INF: 100.0}
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.25)  # first bucket from 0
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.75)
    assert histogram_quantile(0.99, buckets) == pytest.approx(1.9)


def test_a_rank_in_the_inf_bucket_gives_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.99, {1.0: 50.0, 10.0: 90.0, INF: 100.0}) == 10.0


def test_no_observations_no_quantile() -> None:
    assert histogram_quantile(0.99, {1.0: 0.0, INF: 0.0}) is None
    with pytest.raises(ValueError, match=r"^a histogram needs a \+Inf bucket$"):
        histogram_quantile(0.5, {1.0: 3.0})
