"""What one runner process measures of the load it carries, for its capacity gauge.

Per request, over the last reading's span: the rows, the batches, the API workers' CPU (each
call says what its API worker spends per request lately), the process's own CPU outside the
model thread, and, over the last minute's spans, how much of that is the cost of a batch
whatever it holds; for the machine, the cores it leaves idle (`/proc/stat`) and the cores
this process may use at all (its CPU affinity and its cgroup's quota).
`batchserve.runner.policy.capacity` turns a reading into requests a second.

Reading costs two clock reads and two small files, once per `Timeouts.PUBLISH_S` at most,
and only while batches run.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .core.cores import usable_cores
from .policy.capacity import Load
from .policy.latency_model import weighted_line

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MIN_REQUESTS = 20
"""Fewer requests than this in a span say too little about their cost: no reading."""
LONGEST_SPAN_S = 2.0
"""A span longer than this held a pause in the traffic (readings come about once a second
while it flows): its idle cores and its cost per request are the pause's, so it is dropped."""
SPANS_KEPT = 60
"""The last spans (about a minute of traffic) over which the cost of a batch is told apart
from the cost of a request."""
LEAST_SPREAD = 0.25
"""Batches per request must differ by this much across the spans kept to tell them apart."""


def per_batch_s(spans: Sequence[tuple[float, float]]) -> float:
    """From spans of (batches per request, CPU per request outside the model), the CPU a
    batch costs whatever it holds: the slope of the least-squares line, 0 when the spans'
    batches per request hardly differ or the slope is negative. Batches of one request cost
    a runner its wake-ups and frames per request; batches of 16 share them."""
    if len(spans) < 3:
        return 0.0
    each, cost = np.asarray(spans, dtype=float).T
    if np.ptp(each) < LEAST_SPREAD:
        return 0.0
    return max(0.0, weighted_line(each, cost, np.ones_like(each))[1])


def machine_idle_s() -> float | None:
    """Seconds all cores together have been idle since boot, or None where it cannot tell."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 6 or fields[0] != "cpu":
        return None
    return (int(fields[4]) + int(fields[5])) / TICKS_PER_S  # idle and iowait


class LoadMeter:
    """Running totals of what this process served, read into a `Load` per span."""

    def __init__(
        self,
        processes: int = 1,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
        idle_clock: Callable[[], float | None] = machine_idle_s,
        cores: float | None = None,
    ) -> None:
        self.processes = processes
        self.front_s = 0.0  # API worker CPU of every request offered, as their calls said
        self.offered = 0  # requests offered (with a front cost)
        self.requests = 0  # requests (or pieces) in batches run
        self.batches = 0
        self.rows = 0
        self.model_cpu_s = 0.0
        self._clock, self._cpu_clock, self._idle_clock = clock, cpu_clock, idle_clock
        self.cores = usable_cores() if cores is None else cores
        self._spans: deque[tuple[float, float]] = deque(maxlen=SPANS_KEPT)
        self._last = self._totals()

    def offer(self, front_s: float) -> None:
        """One request came, whose API worker spends `front_s` of CPU per request lately."""
        self.front_s += front_s
        self.offered += 1

    def batch(self, requests: int, rows: int, cpu_s: float) -> None:
        """One batch ran: its requests, its rows and the model's CPU for it."""
        self.requests += requests
        self.batches += 1
        self.rows += rows
        self.model_cpu_s += cpu_s

    def _totals(self) -> tuple[float, ...]:
        idle = self._idle_clock()
        return (self._clock(), self._cpu_clock(), -1.0 if idle is None else idle,
                float(self.requests), float(self.rows), self.model_cpu_s, self.front_s,
                float(self.offered), float(self.batches))

    def read(self) -> Load | None:
        """What the span since the last reading measured; None when it saw too few requests
        (the span then runs on), or when it held a pause (a new span starts now)."""
        if self.requests - self._last[3] < MIN_REQUESTS:
            return None
        now = self._totals()
        wall, cpu, idle, requests, rows, model_cpu, front, offered, batches = (
            b - a for a, b in zip(self._last, now, strict=True))
        if wall <= 0.0 or wall > LONGEST_SPAN_S:
            self._last = now
            return None
        known = now[2] >= 0.0 and self._last[2] >= 0.0
        self._last = now
        front_s = front / offered if offered > 0 else 0.0
        loop_s = max(0.0, cpu - model_cpu) / requests
        idle_cores = idle / wall if known else 0.0
        each = batches / requests
        self._spans.append((each, front_s + loop_s))
        # The per-batch part never exceeds what a request costs outside the model now.
        batch_s = min(per_batch_s(self._spans), (front_s + loop_s) / each)
        return Load(
            rows_per_request=rows / requests,
            front_s=front_s,
            loop_s=loop_s,
            used_cores=(cpu + front_s * requests) / wall,
            idle_cores=max(0.0, min(idle_cores, self.cores)),
            processes=self.processes,
            cores=self.cores,
            batches_per_request=each,
            batch_s=batch_s,
            fewest_batches_per_request=min(x for x, _ in self._spans),
        )
