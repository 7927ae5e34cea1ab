"""Batch times recorded on a live runner, for the simulator to replay (`cost: {replay: FILE}`).

A live runner started with `BATCHSERVE_BATCH_LOG=DIR` writes one CSV line per batch, header
`rows,wall_s,cpu_s,predicted_s` (`batchserve.runner.metrics.open_batch_log`); a replay reads
the first three columns, so a log without the prediction replays alike. A `Recording` holds such a
file grouped by row count and answers one question: what might a batch of `n` rows take here?

The rule (docs/dispatcher.md, "The simulator"): draw one recorded batch, uniformly, among those
with the recorded row count `m` nearest to `n` (the smaller on a tie), and scale its wall and
CPU times by `line(n) / line(m)`, where `line` is the least-squares line of CPU time on rows
over the whole file. A row count that was recorded is replayed as it was (the factor is 1);
one outside the recording follows the line, keeping the recorded ratio of wall to CPU time.
"""

from __future__ import annotations

import bisect
import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

HEADER = ("rows", "wall_s", "cpu_s")


class RecordingError(ValueError):
    """A recording cannot be read, or a line of it is not a batch."""


class Sample(NamedTuple):
    """One replayed batch: its wall and CPU seconds, and the CPU seconds each row adds."""

    wall_s: float
    cpu_s: float
    per_row_s: float


@dataclass(frozen=True, slots=True)
class Recording:
    """Recorded batches grouped by rows: `sizes` ascending, `times[i]` the (wall, cpu) pairs of
    the batches of `sizes[i]` rows; `intercept_s + slope_s * n` is the CPU line."""

    path: str
    sizes: tuple[int, ...]
    times: tuple[tuple[tuple[float, float], ...], ...]
    intercept_s: float
    slope_s: float

    @property
    def batches(self) -> int:
        return sum(len(group) for group in self.times)

    def nearest(self, rows: int) -> int:
        """Index in `sizes` of the recorded row count nearest `rows` (the smaller on a tie)."""
        i = bisect.bisect_left(self.sizes, rows)
        if i == len(self.sizes):
            return i - 1
        if i > 0 and rows - self.sizes[i - 1] <= self.sizes[i] - rows:
            return i - 1
        return i

    def line(self, rows: int) -> float:
        return max(self.intercept_s + self.slope_s * rows, 1e-9)

    def sample(self, rows: int, rng: random.Random) -> Sample:
        i = self.nearest(rows)
        group = self.times[i]
        wall, cpu = group[rng.randrange(len(group))] if len(group) > 1 else group[0]
        scale = 1.0 if self.sizes[i] == rows else self.line(rows) / self.line(self.sizes[i])
        return Sample(wall * scale, cpu * scale, self.slope_s * cpu / self.line(self.sizes[i]))


def load_recording(path: str | Path) -> Recording:
    """Read a batch log; raises `RecordingError` naming the file and line of any fault."""
    path = Path(path)
    try:
        with path.open(newline="") as handle:
            lines = list(csv.reader(handle))
    except OSError as exc:
        raise RecordingError(f"cannot read {str(path)!r}: {exc.strerror}") from exc
    if not lines or tuple(field.strip() for field in lines[0][:len(HEADER)]) != HEADER:
        raise RecordingError(f"{str(path)!r} must start with the header {','.join(HEADER)}")
    groups: dict[int, list[tuple[float, float]]] = {}
    for number, line in enumerate(lines[1:], start=2):
        if line:
            rows, wall, cpu = _batch(line, f"{path}:{number}")
            groups.setdefault(rows, []).append((wall, cpu))
    if not groups:
        raise RecordingError(f"{str(path)!r} holds no batch")
    sizes = tuple(sorted(groups))
    intercept, slope = _cpu_line(groups)
    return Recording(str(path), sizes, tuple(tuple(groups[n]) for n in sizes), intercept, slope)


def _batch(line: list[str], where: str) -> tuple[int, float, float]:
    try:
        rows, wall, cpu = int(line[0]), float(line[1]), float(line[2])
    except (ValueError, IndexError) as exc:
        text = ",".join(line)
        raise RecordingError(f"{where} has {text!r}; it must be rows,wall_s,cpu_s") from exc
    if rows < 1 or not (math.isfinite(wall) and math.isfinite(cpu)) or wall <= 0 or cpu < 0:
        raise RecordingError(
            f"{where} has {','.join(line)!r}; rows must be at least 1, wall_s positive "
            "and cpu_s at least 0"
        )
    return rows, wall, cpu


def _cpu_line(groups: dict[int, list[tuple[float, float]]]) -> tuple[float, float]:
    """Least squares of CPU seconds on rows, both terms kept non-negative."""
    points = [(rows, cpu) for rows, group in groups.items() for _, cpu in group]
    count = len(points)
    mean_n = sum(n for n, _ in points) / count
    mean_t = sum(t for _, t in points) / count
    var_n = sum((n - mean_n) ** 2 for n, _ in points)
    if var_n == 0.0:
        return 0.0, mean_t / mean_n  # one size only: through the origin
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / var_n
    if slope < 0.0:
        return mean_t, 0.0
    intercept = mean_t - slope * mean_n
    if intercept < 0.0:
        return 0.0, sum(n * t for n, t in points) / sum(n * n for n, _ in points)
    return intercept, slope


def merge(recordings: list[Recording]) -> Recording:
    """One recording of several processes' logs (a runner with `workers: 2` writes one file per
    process), its CPU line fitted over all of them."""
    groups: dict[int, list[tuple[float, float]]] = {}
    for recording in recordings:
        for rows, group in zip(recording.sizes, recording.times, strict=True):
            groups.setdefault(rows, []).extend(group)
    sizes = tuple(sorted(groups))
    intercept, slope = _cpu_line(groups)
    path = ", ".join(recording.path for recording in recordings)
    return Recording(path, sizes, tuple(tuple(groups[n]) for n in sizes), intercept, slope)
