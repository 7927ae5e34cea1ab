"""Prometheus metrics a runner process records.

Runners and API workers are separate processes, so metrics go through prometheus_client's
multiprocess mode: the supervisor gives every process one `PROMETHEUS_MULTIPROC_DIR`, and an
API worker's `/metrics` merges them. Live gauges keep one series per process (`liveall`), so
a dead runner's gauges disappear when the supervisor marks it dead; a live runner republishes
them every `Timeouts.PUBLISH_S` whether or not traffic flows, so an idle runner reads idle.

Counters count whole requests: a request cut into pieces (over `max_batch_size`) that is
refused or expires counts once in `batchserve_rejections_total`, under the reason it was
answered with. Batches are counted apart (`batchserve_batches_total` and the batch-size
histogram, one observation per batch run).
"""

from __future__ import annotations

import math
import os
import time
from bisect import bisect_left
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

from .core.timeouts import Timeouts
from .load import LoadMeter
from .policy.base import Batch, PolicyStats
from .policy.capacity import capacity


def registry() -> CollectorRegistry:
    """Every process's metrics when the supervisor gave them one folder, else this one's."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return REGISTRY
    collected = CollectorRegistry()
    MultiProcessCollector(collected)  # type: ignore[no-untyped-call]
    return collected

class Tally:
    """Observations for one histogram child, kept in this process and written in bulk.

    A multiprocess metric takes a lock, a pid check and a write to its file at every
    observation, each bucket and sum apart: per request that costs more than the request's
    own bookkeeping. A tally counts into a list instead (`bisect` finds the bucket, as
    Prometheus's `le` bounds read), and `flush` adds what it gathered to the metric, one write
    per bucket touched; `counter`, if given, counts the observations too.
    """

    __slots__ = ("histogram", "counter", "bounds", "counts", "total", "count")

    def __init__(self, histogram: Any, counter: Any = None) -> None:
        self.histogram, self.counter = histogram, counter
        self.bounds: list[float] = list(histogram._upper_bounds)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def flush(self) -> None:
        if not self.count:
            return
        buckets = self.histogram._buckets
        for index, count in enumerate(self.counts):
            if count:
                buckets[index].inc(count)
                self.counts[index] = 0
        self.histogram._sum.inc(self.total)
        if self.counter is not None:
            self.counter.inc(self.count)
        self.total, self.count = 0.0, 0


class Count:
    """A counter child's increments, kept in this process and written in bulk (see `Tally`)."""

    __slots__ = ("counter", "count")

    def __init__(self, counter: Any) -> None:
        self.counter, self.count = counter, 0

    def inc(self) -> None:
        self.count += 1

    def flush(self) -> None:
        if self.count:
            self.counter.inc(self.count)
            self.count = 0


METHOD = "__call__"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048)
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

batch_size = Histogram(
    "batchserve_adaptive_batch_size", "Rows in each batch run (requests, for ragged or pad inputs)",
    ["runner", "method"], buckets=BATCH_BUCKETS,
)
queue_wait = Histogram(
    "batchserve_queue_wait_seconds",
    "Time from a request's arrival to its batch's start (one observation a piece)",
    ["runner"], buckets=SECONDS_BUCKETS,
)
batch_duration = Histogram(
    "batchserve_batch_duration_seconds", "Wall time of each batch: join, model, split",
    ["runner"], buckets=SECONDS_BUCKETS,
)
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
batch_time_ratio = Histogram(
    "batchserve_batch_time_ratio",
    "Each batch's wall time over the high-quantile time the latency model predicted for it; "
    "near 1 at its p99 while the model holds",
    ["runner"], buckets=RATIO_BUCKETS,
)
batch_cpu = Histogram(
    "batchserve_batch_cpu_seconds",
    "CPU time of the model per batch: its thread and its intra-op threads",
    ["runner"], buckets=SECONDS_BUCKETS,
)
rejections = Counter(
    "batchserve_rejections_total",
    "Whole requests the runner answered 503 without running them, by reason: queue "
    "(refused at arrival), expired, draining (a request cut into pieces counts once)",
    ["runner", "reason"],
)
REJECTION_REASONS = ("queue", "expired", "draining")
reads = Counter(
    "batchserve_runner_reads_total",
    "Reads of calls from API workers: a runner process's wakes for arrivals (it reads while "
    "its model is free, so about one per API worker and batch under load)",
    ["runner"],
)
starts = Counter(
    "batchserve_runner_starts_total", "Runner processes started (a restart counts again)",
    ["runner"],
)
batches = Counter(
    "batchserve_batches_total", "Batches released, by why: idle, window, deadline, full, cap",
    ["runner", "reason"],
)
_GAUGES = {
    "window_s": ("batchserve_dispatcher_window_seconds",
                 "The dispatcher's current window: the longest it waits for more rows"),
    "cap": ("batchserve_dispatcher_batch_cap",
            "The dispatcher's current batch cap in rows (elements for ragged or pad inputs)"),
    "intercept_s": ("batchserve_latency_model_intercept_seconds", "Fitted time per batch"),
    "slope_s": ("batchserve_latency_model_slope_seconds",
                "Fitted time per row (per element for ragged or pad inputs)"),
    "p99_batch_s": ("batchserve_predicted_batch_p99_seconds", "Predicted p99 time at the cap"),
    "stretch": ("batchserve_latency_model_stretch", "Wall time over the cost curve, lately"),
    "gap_s": ("batchserve_dispatcher_gap_seconds",
              "Mean idle time of the model between two batches run back to back, lately"),
    "arrival_rps": ("batchserve_arrival_rate", "Estimated arrivals per second"),
    "queued": ("batchserve_queue_depth", "Requests waiting in the dispatcher's queue"),
}
latency_limit = Gauge(
    "batchserve_runner_latency_limit_seconds", "The runner's configured max_latency_ms, in seconds",
    ["runner"], multiprocess_mode="liveall",
)
gauges = {
    field: Gauge(name, text, ["runner"], multiprocess_mode="liveall")
    for field, (name, text) in _GAUGES.items()
}
capacity_rate = Gauge(
    "batchserve_capacity_requests_per_second",
    "Requests a second this runner process can take within its latency limit, as the server "
    "runs now: its latency model, its own and its API workers' CPU per request, the cores "
    "left idle (0 before it is known)",
    ["runner"], multiprocess_mode="liveall",
)
utilization = Gauge(
    "batchserve_utilization",
    "Arrivals over capacity: above 1 the runner refuses what it cannot serve in time",
    ["runner"], multiprocess_mode="liveall",
)


CAPACITY_SMOOTHING_S = 5.0
"""The capacity gauge averages its readings over about this long."""

BATCH_LOG_ENV = "BATCHSERVE_BATCH_LOG"
BATCH_LOG_HEADER = "rows,wall_s,cpu_s,predicted_s\n"


def open_batch_log(runner: str) -> TextIO | None:
    """`$BATCHSERVE_BATCH_LOG/<runner>-<pid>.csv` when that folder is named, else None.

    One line per batch (rows, wall and CPU seconds): what the simulator replays
    (`cost: {replay: FILE}`) to meet the batch times of a real machine; and the high-quantile
    time the latency model predicted for it, so a batch's time can be set beside its
    prediction by size (`benchmarks.model_table`).
    """
    folder = os.environ.get(BATCH_LOG_ENV)
    if not folder:
        return None
    path = Path(folder) / f"{runner}-{os.getpid()}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.open("w", buffering=1 << 16)
    log.write(BATCH_LOG_HEADER)
    return log


class RunnerMetrics:
    """The metric children of one runner, resolved once so the hot path does no lookups.

    Batches and rejections are tallied in the process (`Tally`, `Count`) and written out by
    `flush`: with the gauges every `Timeouts.GAUGE_PERIOD_S` while batches run, and whenever the
    dispatcher falls idle, so a scrape after the last answer reads every request of it.
    """

    def __init__(self, runner: str, latency_limit_s: float = 0.0, max_batch: int = 1,
                 processes: int = 1) -> None:
        self.runner = runner
        self.latency_limit_s, self.max_batch = latency_limit_s, max_batch
        self.load = LoadMeter(processes)
        self.capacity_rps = 0.0
        self._capacity = capacity_rate.labels(runner)
        self._utilization = utilization.labels(runner)
        self._measured = time.monotonic()
        starts.labels(runner).inc()
        latency_limit.labels(runner).set(latency_limit_s)
        # Every reason's series exists from the start, so a rate over it reads 0, not nothing.
        self._rejections = {reason: Count(rejections.labels(runner, reason))
                            for reason in REJECTION_REASONS}
        self._batches: dict[str, Count] = {}
        self._batch_size = Tally(batch_size.labels(runner, METHOD))
        self._queue_wait = Tally(queue_wait.labels(runner))
        self._duration = Tally(batch_duration.labels(runner))
        self._ratio = Tally(batch_time_ratio.labels(runner))
        self._cpu = Tally(batch_cpu.labels(runner))
        self.reads = Count(reads.labels(runner))
        self._tallies: list[Tally | Count] = [
            *self._rejections.values(), self._batch_size, self._queue_wait, self._duration,
            self._ratio, self._cpu, self.reads]
        self._gauges = {field: gauge.labels(runner) for field, gauge in gauges.items()}
        self._published = 0.0
        self._log = open_batch_log(runner)

    def batch(
        self, batch: Batch, started: float, finished: float, cpu_s: float, rows: int | None = None
    ) -> None:
        """One batch run; `rows` when its size for the policy counts something else (the
        elements of ragged or pad inputs): the batch-size histogram counts rows."""
        self._batch_size.observe(batch.rows if rows is None else rows)
        self._duration.observe(finished - started)
        self._cpu.observe(cpu_s)
        self.load.batch(len(batch.requests), batch.rows, cpu_s)
        if batch.predicted_s > 0.0:
            self._ratio.observe((finished - started) / batch.predicted_s)
        count = self._batches.get(batch.reason)
        if count is None:
            count = self._batches[batch.reason] = Count(batches.labels(self.runner, batch.reason))
            self._tallies.append(count)
        count.inc()
        observe = self._queue_wait.observe
        for request in batch.requests:
            observe(max(0.0, started - request.arrival))
        if self._log is not None:
            self._log.write(f"{batch.rows},{finished - started:.7f},{cpu_s:.7f},"
                            f"{batch.predicted_s:.7f}\n")

    def close(self) -> None:
        self.flush()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _measure(self, stats: PolicyStats) -> None:
        """The capacity, from the latency model and what the span since the last reading
        cost per request (kept as it was when the span saw too few requests)."""
        load = self.load.read()
        if load is None or stats.fit is None:
            return
        now = time.monotonic()
        measured = capacity(stats.fit, self.latency_limit_s, self.max_batch, load)
        # One span is a second or so of a noisy machine: averaged over the last several.
        weight = 1.0 - math.exp(-(now - self._measured) / CAPACITY_SMOOTHING_S)
        self._measured = now
        self.capacity_rps = measured if self.capacity_rps == 0.0 else (
            self.capacity_rps + weight * (measured - self.capacity_rps))
        self._capacity.set(self.capacity_rps)

    def rejected(self, reason: str) -> None:
        """One whole request answered 503 by the runner, for `reason`."""
        count = self._rejections.get(reason)
        if count is None:
            count = self._rejections[reason] = Count(rejections.labels(self.runner, reason))
            self._tallies.append(count)
        count.inc()

    def flush(self) -> None:
        """Write what was tallied since the last flush to the metrics."""
        for tally in self._tallies:
            tally.flush()

    def publish(self, stats: PolicyStats, force: bool = False) -> None:
        """Copy the policy's live state into the gauges and flush the tallies, at most every
        `Timeouts.GAUGE_PERIOD_S` unless `force` (the periodic publish), which also flushes the
        batch log."""
        now = time.monotonic()
        if not force and now - self._published < Timeouts.GAUGE_PERIOD_S:
            return
        self._published = now
        self.flush()
        for field, gauge in self._gauges.items():
            gauge.set(getattr(stats, field))
        if now - self._measured >= Timeouts.PUBLISH_S:
            self._measure(stats)
        rate = self.capacity_rps
        self._utilization.set(stats.arrival_rps / rate if rate > 0.0 else 0.0)
        if force and self._log is not None:
            self._log.flush()
