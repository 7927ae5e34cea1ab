"""Predicted against observed batch time, by batch size, from a runner's batch log.

Pure: takes the lines a live runner wrote (`BATCHSERVE_BATCH_LOG`: rows, wall, CPU and the
high-quantile time the latency model predicted for the batch when it released it), returns
rows of a table and its text. A batch's size is what the policy counts (rows, or elements for
ragged or pad inputs); sizes are grouped in buckets that double (1, 2, 3-4, 5-8, ...), in
units of `unit` rows (a sequence's tokens, when every request is one sequence of that many).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from benchmarks.live_report import RATIO_BAND  # the live table's band: the same judgement


class Logged(NamedTuple):
    """One batch of a runner's log: its size, wall seconds and predicted high-quantile seconds."""

    rows: int
    wall_s: float
    predicted_s: float


def parse(lines: Iterable[str]) -> list[Logged]:
    """The batches of log lines (`rows,wall_s,cpu_s,predicted_s`), the header and any line
    without a prediction (a log written before the prediction was logged) left out."""
    batches = []
    for line in lines:
        fields = line.strip().split(",")
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        predicted = float(fields[3])
        if predicted > 0.0:
            batches.append(Logged(int(fields[0]), float(fields[1]), predicted))
    return batches


def bucket(requests: int) -> tuple[int, int]:
    """The doubling bucket of a size: 1, 2, 3-4, 5-8, 9-16, ... as (lowest, highest)."""
    high = 1
    while high < requests:
        high *= 2
    return (high // 2 + 1 if high > 2 else high), high


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by rank (the value below which a share q of them lie)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class SizeRow:
    """The batches of one size bucket: how many, their observed wall time at the median and
    the 99th percentile, the median of what was predicted for them (the high quantile), and
    the 99th percentile of each batch's observed over predicted time."""

    model: str
    sizes: tuple[int, int]  # in requests (rows over `unit`)
    batches: int
    p50_ms: float
    p99_ms: float
    predicted_ms: float
    ratio_p99: float

    @property
    def observed_over_predicted(self) -> float:
        return self.p99_ms / self.predicted_ms

    @property
    def holds(self) -> bool:
        return RATIO_BAND[0] <= self.ratio_p99 <= RATIO_BAND[1]

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "sizes": list(self.sizes), "batches": self.batches,
                "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
                "predicted_ms": self.predicted_ms, "ratio_p99": self.ratio_p99,
                "holds": self.holds}


def by_size(model: str, batches: Sequence[Logged], unit: int = 1) -> list[SizeRow]:
    """One row per size bucket that holds a batch, smallest first."""
    groups: dict[tuple[int, int], list[Logged]] = {}
    for batch in batches:
        groups.setdefault(bucket(max(1, round(batch.rows / unit))), []).append(batch)
    rows = []
    for sizes in sorted(groups):
        group = groups[sizes]
        walls = [b.wall_s * 1000.0 for b in group]
        rows.append(SizeRow(
            model, sizes, len(group), quantile(walls, 0.5), quantile(walls, 0.99),
            quantile([b.predicted_s * 1000.0 for b in group], 0.5),
            quantile([b.wall_s / b.predicted_s for b in group], 0.99)))
    return rows


def _sizes(sizes: tuple[int, int]) -> str:
    low, high = sizes
    return f"{low}" if low == high else f"{low}-{high}"


def markdown(rows: Sequence[SizeRow]) -> str:
    lines = ["| model | batch size (requests) | batches | observed p50 ms | observed p99 ms | "
             "predicted p99 ms | observed p99 / predicted | ratio p99 | in band |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {_sizes(r.sizes)} | {r.batches} | {r.p50_ms:.1f} | "
                     f"{r.p99_ms:.1f} | {r.predicted_ms:.1f} | "
                     f"{r.observed_over_predicted:.2f} | {r.ratio_p99:.2f} | "
                     f"{'yes' if r.holds else '**no**'} |")
    return "\n".join(lines)
