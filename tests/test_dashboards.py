"""The Grafana dashboard loads and queries only metrics that batchserve exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

# Importing the modules that define metrics registers them with prometheus_client's default
# registry: the API workers' (app, service) and the runners' (runner.metrics).
from batchserve.api import service  # noqa: F401
from batchserve.api.http import app  # noqa: F401
from batchserve.runner import metrics  # noqa: F401

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "batchserve.json"
PREFIX = "batchserve_"
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}
"""The series each kind of metric family writes to the server's `/metrics`. That page merges
every process's files (prometheus_client's multiprocess mode), which write no `_created`
series: a panel on one would read nothing, so none counts as exported."""


def _exported() -> dict[str, tuple[str, str]]:
    """Every series name batchserve's metrics put on `/metrics`: its family and the family's
    type, read from the registry the code fills (a counter's family is named without
    `_total`)."""
    series: dict[str, tuple[str, str]] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith(PREFIX):
            continue
        assert family.type in SUFFIXES, f"{family.name}: no series known for {family.type}"
        for suffix in SUFFIXES[family.type]:
            series[f"{family.name}{suffix}"] = (family.name, family.type)
    return series


def _label_names() -> dict[str, set[str]]:
    """Each exported series' labels, read from the registered metrics (a labelled metric
    without a sample yet is in the registry, not in `collect()`): a histogram's buckets add
    `le`, a gauge kept per process `pid`."""
    labels: dict[str, set[str]] = {}
    for metric in REGISTRY._collector_to_names:
        name = getattr(metric, "_name", "")
        if not name.startswith(PREFIX):
            continue
        own = set(metric._labelnames)
        if getattr(metric, "_multiprocess_mode", None) in {"liveall", "all"}:
            own.add("pid")
        for suffix in SUFFIXES[metric._type]:
            labels[f"{name}{suffix}"] = own | ({"le"} if suffix == "_bucket" else set())
    return labels


SERIES = _exported()
LABELS = _label_names()
GROUPED = re.compile(r"\bby \(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
FAMILIES = {family for family, _ in SERIES.values()}
GAUGES = {name for name, (_, kind) in SERIES.items() if kind == "gauge"}
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
        assert names <= SERIES.keys(), f"unknown metric {names - SERIES.keys()} in {expr!r}"


def test_every_exported_metric_is_shown(dashboard: dict[str, Any]) -> None:
    used = {name for expr in _exprs(dashboard) for name in METRIC.findall(expr)}
    shown = {SERIES[name][0] for name in used if name in SERIES}
    assert FAMILIES - shown == set(), f"exported but on no panel: {sorted(FAMILIES - shown)}"


def test_every_label_a_panel_groups_by_is_one_its_metrics_carry(
        dashboard: dict[str, Any]) -> None:
    """A `by (...)` or a legend's `{{label}}` naming a label no metric of the expression has
    reads as one series where the metric has many (a pipeline's steps, say)."""
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            carried = set().union(*(LABELS[name] for name in METRIC.findall(expr)))
            grouped = {label.strip() for labels in GROUPED.findall(expr)
                       for label in labels.split(",") if label.strip()}
            shown = set(LEGEND.findall(target.get("legendFormat", "")))
            assert grouped | shown <= carried, \
                f"{panel['title']!r}: {sorted((grouped | shown) - carried)} not on {expr!r}"


def test_a_pipeline_step_is_labelled_by_its_position_and_runner() -> None:
    """A runner used twice in one chain is two steps: both are counted, and apart."""
    assert LABELS["batchserve_pipeline_refusals_total"] == {"pipeline", "step", "runner"}


def test_the_exported_series_are_read_from_the_code() -> None:
    """Each kind the server exports is found, so an empty or partial registry cannot make
    the two tests above pass."""
    kinds = {kind for _, kind in SERIES.values()}
    assert kinds == {"counter", "gauge", "histogram"}
    assert "batchserve_requests_total" in SERIES and "batchserve_requests" not in SERIES
    assert {"batchserve_queue_wait_seconds_bucket", "batchserve_queue_wait_seconds_count"} \
        <= SERIES.keys()
    assert "batchserve_queue_wait_seconds_created" not in SERIES


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
