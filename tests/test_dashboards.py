"""The Grafana dashboard loads and queries only metrics that batchserve exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "batchserve.json"

HISTOGRAMS = {
    "batchserve_adaptive_batch_size",
    "batchserve_request_duration_seconds",
    "batchserve_queue_wait_seconds",
    "batchserve_batch_duration_seconds",
    "batchserve_batch_time_ratio",
    "batchserve_batch_cpu_seconds",
    "batchserve_api_loop_lag_seconds",
}
COUNTERS = {
    "batchserve_requests_total",
    "batchserve_rejections_total",
    "batchserve_batches_total",
    "batchserve_unavailable_total",
    "batchserve_runner_starts_total",
}
GAUGES = {
    "batchserve_dispatcher_window_seconds",
    "batchserve_dispatcher_batch_cap",
    "batchserve_latency_model_intercept_seconds",
    "batchserve_latency_model_slope_seconds",
    "batchserve_predicted_batch_p99_seconds",
    "batchserve_arrival_rate",
    "batchserve_queue_depth",
    "batchserve_latency_model_stretch",
    "batchserve_dispatcher_gap_seconds",
    "batchserve_capacity_requests_per_second",
    "batchserve_utilization",
    "batchserve_runner_latency_limit_seconds",
    "batchserve_inflight_requests",
    "batchserve_runner_processes_connected",
    "batchserve_runner_processes_configured",
}
SERIES = (
    COUNTERS
    | GAUGES
    | {f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
)
METRIC = re.compile(r"\bbatchserve_[a-z0-9_]+")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def test_dashboard_is_a_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == "batchserve"
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))


def test_datasource_is_a_prometheus_variable(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]


def test_every_expression_uses_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    for expr in _exprs(dashboard):
        names = set(METRIC.findall(expr))
        assert names, f"no batchserve metric in {expr!r}"
        assert names <= SERIES, f"unknown metric {names - SERIES} in {expr!r}"


def test_every_exported_metric_is_shown(dashboard: dict[str, Any]) -> None:
    used = {name for expr in _exprs(dashboard) for name in METRIC.findall(expr)}
    bases = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    assert HISTOGRAMS | COUNTERS | GAUGES <= bases


def test_quantiles_keep_le_and_gauges_are_aggregated(dashboard: dict[str, Any]) -> None:
    """Each process exports its own series: a panel must combine them per runner (the API
    workers' loop lag belongs to no runner: over all workers)."""
    for expr in _exprs(dashboard):
        if "histogram_quantile" in expr:
            per_runner = "batchserve_api_loop_lag_seconds" not in expr
            assert re.search(r"sum by \(le, runner" if per_runner else r"sum by \(le\)", expr), expr
        for gauge in GAUGES & set(METRIC.findall(expr)):
            assert re.search(rf"(max|min|sum) by \(runner\) \({gauge}\b", expr), expr


def test_panels_the_first_questions_need(dashboard: dict[str, Any]) -> None:
    """Batch sizes over time, latency against the limit, 503s by reason, model sanity."""
    by_title = {panel["title"]: panel for panel in _panels(dashboard)}
    assert by_title["Batch size distribution"]["type"] == "heatmap"
    limit = [t["expr"] for t in by_title["p99 latency against the runner's limit"]["targets"]]
    assert any("batchserve_runner_latency_limit_seconds" in expr for expr in limit)
    reasons = by_title["503s / s by reason"]["targets"][0]["expr"]
    assert "batchserve_unavailable_total" in reasons and "reason" in reasons
    ratio = by_title["Observed / predicted p99 batch time"]["targets"]
    assert any("batchserve_batch_time_ratio_bucket" in t["expr"] for t in ratio)
