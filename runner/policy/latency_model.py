"""The batch latency model: a CPU cost curve in batch rows, stretched by the machine's contention.

A policy asks two questions many times a second: how long will a batch of `n` rows take on
average (to decide whether waiting pays), and how long may it take in the bad case (to promise
deadlines). Both are answered from a `Fit`, a frozen value of a few floats, so the hot path does
a multiply and an add. The fit itself runs on a snapshot of samples, off the request's critical
path: see `fit_samples` and docs/dispatcher.md.

Why two parts:
- The cost curve `intercept + slope * n` is fitted on the model's CPU time (its thread's and
  its intra-op threads'), not its wall time. On shared cores the wall time of a batch also
  holds waits for a core and for the GIL, which do not grow with its rows but do come in
  episodes: a slow batch lets more requests queue, so the next batch is both large and slow,
  and a line fitted on wall time takes that for cost per row (slopes 30 times the truth were
  seen live). CPU time has none of those waits.
  A model that mostly waits (on a GPU, a sleep, I/O) costs its thread little CPU, so the
  calibration decides the unit: CPU seconds when the model kept its thread busy for at least
  half of each calibration batch, wall seconds otherwise.
- The stretch is what requests actually feel: wall time over the curve, a robust median over
  the recent batches. It carries contention, GC pauses and the like as one factor. It moves
  at most `Tuning.max_move`-fold per refit and follows a shift in either direction (`shift`), so
  one burst cannot fling the model far and no state outlives the batches that disprove it.
- A Huber fit for the curve: one batch delayed by a page fault must not tilt it. Recency
  weights with a half-life counted in batches follow a change of cost within a few dozen
  batches. Calibration samples (a few batch sizes timed before the runner is ready) stay with
  a small weight: at low load every live batch has one row, and without them slope and
  intercept could not be told apart (BentoML's failure).
- The high quantile is the mean times a factor: `1 + k * spread`, where spread is a robust
  (MAD) estimate of the relative deviation of the stretch (batch time noise is
  multiplicative), or the recent stretches' own 99th percentile over their median if that
  is more: contention on shared cores has a heavier tail than a normal law, and a promise
  must cover the tail that is there. Until a hundred batches can show a 99th percentile, one
  hiccup among them may not raise it more than `Tuning.max_move`-fold over the last one read.
- The fit also says how far its own line may be off (`Fit.error`): recency weights leave a
  new batch size resting on a handful of batches, and a promise over several batches leans
  on the same line in each.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .tuning import DEFAULT_TUNING, Tuning

MAD_TO_SIGMA = 1.4826  # scales a median absolute deviation to a normal standard deviation
HUBER_EPSILON = 1.345  # residuals beyond this many sigmas count linearly, not squared
HUBER_ROUNDS = 4

class Timing(NamedTuple):
    """One batch timed before traffic: its rows, wall seconds and the model's CPU seconds."""

    rows: int
    wall_s: float
    cpu_s: float


@dataclass(frozen=True, slots=True)
class Fit:
    """Batch wall time in seconds: mean(n) = intercept + slope * n; high(n) = mean(n) * factor.

    `stretch` is the factor by which wall time exceeded the cost curve lately, so
    `cost(n) = mean(n) / stretch` is what the batch costs on an idle machine.
    """

    intercept_s: float = 0.0
    slope_s: float = 0.0
    spread: float = 0.0
    factor: float = 1.0
    samples: int = 0
    stretch: float = 1.0
    cost_factor: float = 1.0
    overruns: tuple[float, ...] = ()
    """The `Tuning.longest_overruns` largest of wall time minus `mean` over the recent
    batches, ascending."""
    tail: float = 1.0
    """The recent stretches' 99th percentile over their median, as last read from at least
    `Tuning.tail_samples` batches."""
    error: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The fitted line's own uncertainty, as the variances of its intercept and slope and
    their covariance (s², s²/row², s²/row): what its samples, each as noisy as the cost
    spread says, leave unknown."""

    def line_error(self, batches: float, rows: float) -> float:
        """The standard error of the summed means of `batches` batches of `rows` rows in all:
        an error in the line is shared by every batch, so it adds up whole."""
        v_intercept, v_both, v_slope = self.error
        variance = (batches * batches * v_intercept + 2.0 * batches * rows * v_both
                    + rows * rows * v_slope)
        return math.sqrt(max(variance, 0.0))

    def mean(self, rows: int) -> float:
        return self.intercept_s + self.slope_s * rows

    def high(self, rows: int) -> float:
        return (self.intercept_s + self.slope_s * rows) * self.factor

    def curve(self, rows: int) -> float:
        """The fitted cost curve, in the unit it was fitted in."""
        return (self.intercept_s + self.slope_s * rows) / self.stretch

    def cost(self, rows: int) -> float:
        """What the batch takes on an idle machine: the curve, but never more than the batch
        takes now. A curve learned in a busy spell (a model that waits is fitted on wall
        time) sits above what batches take once it passes, with a stretch below 1 until the
        refits catch up; read as the idle cost, it refused every request as too slow for
        the limit (413), even an idle model's, so no batch ran that could correct it."""
        return self.mean(rows) / max(self.stretch, 1.0)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The inputs of one refit, copied so the fit can run on another thread."""

    rows: tuple[int, ...]
    cost_s: tuple[float, ...]
    weights: tuple[float, ...]
    recent_rows: tuple[int, ...]
    recent_wall_s: tuple[float, ...]
    previous: Fit
    tuning: Tuning
    seeds: int = 0
    """How many of the recent samples, first, are the calibration's (see `fit_samples`)."""


class Shifts:
    """Counts batches in a row on one side of a band around the prediction."""

    __slots__ = ("run", "side", "ratios")

    def __init__(self, run: int) -> None:
        self.run = run
        self.side = 0
        self.ratios: list[float] = []

    def observe(self, ratio: float, factor: float) -> float | None:
        """`ratio` is measured over predicted; the median ratio once `run` in a row fell
        beyond `factor` on the same side, else None."""
        side = 1 if ratio > factor else -1 if ratio * factor < 1.0 else 0
        if side == 0 or side != self.side:
            self.side, self.ratios = side, [ratio] if side else []
            return None
        self.ratios.append(ratio)
        if len(self.ratios) < self.run:
            return None
        shift = sorted(self.ratios)[len(self.ratios) // 2]
        self.side, self.ratios = 0, []
        return shift


class LatencyModel:
    """Measured batches (rows, wall, CPU) plus the calibration samples, and the current fit.

    Owns no clock: samples are ordered by arrival, and recency is counted in batches.
    """

    def __init__(self, tuning: Tuning = DEFAULT_TUNING) -> None:
        self.tuning = tuning
        # rows and cost seconds; rows and wall seconds; the calibration's rows and cost seconds
        self.samples: deque[tuple[int, float]] = deque(maxlen=tuning.sample_window)
        self.recent: deque[tuple[int, float]] = deque(maxlen=tuning.stretch_window)
        self.calibration: list[tuple[int, float]] = []
        self._seeds = 0
        """The calibration's samples still at the front of `recent` (see `_seeded`)."""
        self.cpu_bound = True
        self.quantile_k = tuning.quantile_k
        self.fit = Fit()
        self.first: Fit | None = None
        """The calibration's own line, as measured before any traffic: see `idle_cost`."""
        self._cost_shifts = Shifts(tuning.shift_run)
        self._stretch_shifts = Shifts(tuning.shift_run)

    def add(self, rows: int, wall_s: float, cpu_s: float) -> bool:
        """Record one batch; True when it completes a shift, so a refit is due at once.

        A shift in cost (CPU time, or wall time for a model that waits) is a change of the
        model's own cost: the curve restarts from the newest batches and the calibration is
        scaled by the shift (at most `Tuning.max_move`-fold), or it would pull every later fit
        back to the old cost. A shift in wall time against the
        curve is a change of contention: only the stretch restarts. Either way, in both
        directions, so the model comes back down when batches are fast again.
        """
        spent = cpu_s if self.cpu_bound else wall_s
        self.samples.append((rows, spent))
        self.recent.append((rows, wall_s))
        self._seeded()
        fit = self.fit
        if not fit.samples:
            return False
        cost = self._cost_shifts.observe(spent / max(fit.curve(rows), 1e-9), fit.cost_factor)
        if cost is not None:
            self._restart(self.samples)
            most = self.tuning.max_move
            scale = min(max(cost, 1.0 / most), most)
            self.calibration = [(n, seconds * scale) for n, seconds in self.calibration]
        wall = self._stretch_shifts.observe(wall_s / max(fit.mean(rows), 1e-9), fit.factor)
        if wall is not None:
            self._restart(self.recent)
            self._seeds = 0
        return cost is not None or wall is not None

    def _seeded(self) -> None:
        """Drop the calibration's samples from the stretch's window once live batches alone
        hold a 99th percentile (`Tuning.tail_samples`): timed while the server's other runners
        calibrated on the same cores, a few of them cost twice the line, and among a few
        hundred steady batches those few would be the tail that every promise is made with."""
        if self._seeds and len(self.recent) - self._seeds >= self.tuning.tail_samples:
            for _ in range(self._seeds):
                self.recent.popleft()
            self._seeds = 0

    def _restart(self, samples: deque[tuple[int, float]]) -> None:
        while len(samples) > self.tuning.shift_run:
            samples.popleft()

    def calibrate(self, timings: Sequence[Timing]) -> None:
        """Batches (rows, wall, CPU seconds) timed before any traffic: they choose the unit
        of the cost curve, anchor its shape, and are the stretch's first samples, at their
        cost (a stretch of 1) rather than their wall time."""
        shares = sorted(cpu / wall for _, wall, cpu in timings if wall > 0.0)
        self.cpu_bound = not shares or shares[len(shares) // 2] >= 0.5
        self.calibration = [(n, cpu if self.cpu_bound else wall) for n, wall, cpu in timings]
        if self.calibration:
            rows = np.asarray([n for n, _ in self.calibration], dtype=float)
            millis = np.asarray([seconds for _, seconds in self.calibration]) * 1000.0
            intercept, slope, _ = _line(rows, millis, np.ones_like(rows))
            self.first = Fit(intercept_s=intercept / 1000.0, slope_s=slope / 1000.0)
        # The stretch starts at 1, from the calibration's cost: its wall times were taken while
        # the server's other runners calibrate too, and with their models on the same cores a
        # ResNet's read up to 3.5 times its CPU time, a tail that outlived hundreds of batches.
        self.recent.clear()
        self.recent.extend(self.calibration)
        self._seeds = len(self.calibration)

    def idle_cost(self, rows: int) -> float:
        """What a batch of `rows` takes on an idle machine: the fit's `cost`, but never more
        than the calibration's line, measured before any traffic, says.

        Judged on the fit alone, a few batches slowed by a busy spell (a model that waits is
        fitted on wall time, and three slow batches in a row restart its curve) could put a
        single row past the latency limit: every request would be refused as too large for
        it (413), even by an idle model, and no batch would run to disprove the curve.
        """
        cost = self.fit.cost(rows)
        return cost if self.first is None else min(cost, self.first.mean(rows))

    def snapshot(self) -> Snapshot:
        live = list(self.samples)
        weights = _recency(len(live), self.tuning.half_life)
        weights += [self.tuning.calibration_weight] * len(self.calibration)
        every = live + self.calibration
        recent = list(self.recent)
        return Snapshot(
            rows=tuple(rows for rows, _ in every),
            cost_s=tuple(seconds for _, seconds in every),
            weights=tuple(weights),
            recent_rows=tuple(rows for rows, _ in recent),
            recent_wall_s=tuple(wall for _, wall in recent),
            previous=self.fit,
            tuning=self.tuning,
            seeds=self._seeds,
        )


def _recency(count: int, half_life: float) -> list[float]:
    """Weights that halve every `half_life` samples back from the newest (last)."""
    decay = 0.5 ** (1.0 / half_life)
    return [decay ** (count - 1 - i) for i in range(count)]


def fit_samples(snapshot: Snapshot) -> Fit:
    """Fit the cost curve, then the stretch and its spread; pure, safe to run on any thread."""
    if not snapshot.rows:
        return snapshot.previous
    tuning = snapshot.tuning
    rows = np.asarray(snapshot.rows, dtype=float)
    millis = np.asarray(snapshot.cost_s, dtype=float) * 1000.0  # Huber's tolerances like ms
    weights = np.asarray(snapshot.weights, dtype=float)
    intercept, slope, used = _line(rows, millis, weights)
    cost_spread = max(
        _robust_spread(millis / np.maximum(intercept + slope * rows, 1e-9) - 1.0, weights),
        tuning.min_spread,
    )
    if snapshot.recent_rows:
        recent = np.asarray(snapshot.recent_rows, dtype=float)
        curve = np.maximum(intercept + slope * recent, 1e-9)
        stretches = np.asarray(snapshot.recent_wall_s, dtype=float) * 1000.0 / curve
        stretch, spread = _stretch(stretches, tuning, snapshot.previous)
        # Once a few live batches came, the tail is theirs: the calibration ran while the
        # server's other runners calibrated on the same cores, and its few outliers, read as
        # the tail, doubled the promises of a runner just started.
        if stretches.size - snapshot.seeds >= tuning.few_recent:
            stretches, curve = stretches[snapshot.seeds:], curve[snapshot.seeds:]
        tail = read = _quantile(stretches, tuning.tail_quantile) / stretch
        if stretches.size <= tuning.tail_samples:
            read = snapshot.previous.tail
            tail = min(tail, read * tuning.max_move)
        overrun = (stretches - stretch) * curve / 1000.0
        overruns = tuple(float(x) for x in np.sort(overrun)[-tuning.longest_overruns:])
    else:
        stretch, spread, tail = snapshot.previous.stretch, cost_spread, 1.0
        read = snapshot.previous.tail
        overruns = snapshot.previous.overruns
    spread = max(spread, tuning.min_spread)
    scale = stretch / 1000.0
    v_intercept, v_both, v_slope = _line_covariance(rows, used, intercept, slope, cost_spread)
    return Fit(
        intercept_s=stretch * intercept / 1000.0,
        slope_s=stretch * slope / 1000.0,
        spread=spread,
        factor=max(1.0 + tuning.quantile_k * spread, tail),
        samples=len(snapshot.rows),
        stretch=stretch,
        cost_factor=1.0 + tuning.quantile_k * cost_spread,
        overruns=overruns,
        tail=read,
        error=(v_intercept * scale * scale, v_both * scale * scale, v_slope * scale * scale),
    )


def _stretch(stretches: np.ndarray, tuning: Tuning, previous: Fit) -> tuple[float, float]:
    """The recency-weighted median stretch, moved at most `max_move`-fold from the last, and
    the spread of stretches around it."""
    weights = np.asarray(_recency(stretches.size, tuning.half_life))
    median = _weighted_median(stretches, weights)
    if previous.samples:
        most = tuning.max_move
        median = min(max(median, previous.stretch / most), previous.stretch * most)
    spread = _robust_spread(stretches / median - 1.0, weights)
    if stretches.size < tuning.few_recent:
        spread = max(spread, previous.spread)
    return median, spread


def _quantile(values: np.ndarray, q: float) -> float:
    """The q-quantile of the values; the largest when there are too few to tell."""
    ordered = np.sort(values)
    return float(ordered[min(ordered.size - 1, int(q * ordered.size))])


def _line(
    rows: np.ndarray, millis: np.ndarray, weights: np.ndarray
) -> tuple[float, float, np.ndarray]:
    """Intercept and slope (ms, ms/row), both kept non-negative, and the weights they were
    fitted with (the robust ones included)."""
    if np.unique(rows).size < 2:
        # One size only (no calibration): a line through the origin is the cautious guess, as
        # it over-predicts larger batches; the cap stays small until larger sizes are seen.
        mean = float(np.average(millis / rows, weights=weights))
        return 0.0, mean, weights
    intercept, slope, used = _huber(rows, millis, weights)
    if slope < 0.0:
        return float(np.average(millis, weights=weights)), 0.0, used
    if intercept < 0.0:
        return 0.0, _through_origin(rows, millis, weights), used
    return intercept, slope, used


def _line_covariance(
    rows: np.ndarray, weights: np.ndarray, intercept: float, slope: float, spread: float
) -> tuple[float, float, float]:
    """The covariance of a weighted line's intercept and slope when each sample's noise is
    `spread` of its mean (the sandwich estimate: the weights are recency's, not the noise's).

    The recency weights keep few of the large batches a load step brings: in the first
    seconds the slope stands on a handful of them, and their noise is the promise's too.
    """
    s0, s1, s2 = (float(np.sum(weights)), float(np.dot(weights, rows)),
                  float(np.dot(weights, rows * rows)))
    det = s0 * s2 - s1 * s1
    if det <= 0.0:
        return 0.0, 0.0, 0.0
    noise = weights * spread * (intercept + slope * rows)
    w2 = noise * noise
    m0, m1, m2 = float(np.sum(w2)), float(np.dot(w2, rows)), float(np.dot(w2, rows * rows))
    # the inverse of [[s0, s1], [s1, s2]] is [[s2, -s1], [-s1, s0]] / det
    a, b, c = s2 / det, -s1 / det, s0 / det
    v00 = a * a * m0 + 2 * a * b * m1 + b * b * m2
    v01 = a * b * m0 + (a * c + b * b) * m1 + b * c * m2
    v11 = b * b * m0 + 2 * b * c * m1 + c * c * m2
    return v00, v01, v11


def _through_origin(rows: np.ndarray, millis: np.ndarray, weights: np.ndarray) -> float:
    return float(np.sum(weights * rows * millis) / np.sum(weights * rows * rows))


def _huber(
    rows: np.ndarray, millis: np.ndarray, weights: np.ndarray
) -> tuple[float, float, np.ndarray]:
    """A Huber M-estimate by iteratively reweighted least squares, each round in closed form.

    One feature needs no solver: four weighted means per round, some microseconds in all,
    where scikit-learn's estimators held the GIL for milliseconds beside the model thread.
    """
    robust = np.ones_like(weights)
    intercept = slope = 0.0
    for _ in range(HUBER_ROUNDS):
        intercept, slope = weighted_line(rows, millis, weights * robust)
        residual = millis - (intercept + slope * rows)
        scale = MAD_TO_SIGMA * _weighted_median(np.abs(residual), weights)
        if scale <= 0.0:
            break
        robust = np.minimum(1.0, HUBER_EPSILON * scale / np.maximum(np.abs(residual), 1e-12))
    return intercept, slope, weights * robust


def weighted_line(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """The weighted least-squares line's intercept and slope (slope 0 when x does not vary)."""
    total = float(np.sum(w))
    mean_x = float(np.dot(w, x)) / total
    mean_y = float(np.dot(w, y)) / total
    dx = x - mean_x
    spread_x = float(np.dot(w, dx * dx))
    slope = float(np.dot(w, dx * (y - mean_y))) / spread_x if spread_x > 0.0 else 0.0
    return mean_y - slope * mean_x, slope


def _robust_spread(relative: np.ndarray, weights: np.ndarray) -> float:
    """A weighted MAD of relative residuals, scaled to a normal sigma."""
    centre = _weighted_median(relative, weights)
    return MAD_TO_SIGMA * _weighted_median(np.abs(relative - centre), weights)


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    index = int(np.searchsorted(cumulative, cumulative[-1] / 2.0))
    return float(values[order][min(index, values.size - 1)])


class RecentQuantile:
    """The mean and a high quantile of the last `window` values, estimated again every
    `every` new values: the idle gap between batches (the adaptive policy) and the answers'
    way home (the API's reserve) are both read this way."""

    def __init__(self, window: int, every: int, quantile: float) -> None:
        self._seen: deque[float] = deque(maxlen=window)
        self._every = every
        self._quantile = quantile
        self._fresh = 0
        self.mean = 0.0
        self.high = 0.0

    def add(self, value: float) -> None:
        self._seen.append(value)
        self._fresh += 1
        if self._fresh >= self._every:
            self._fresh = 0
            ranked = sorted(self._seen)
            self.mean = sum(ranked) / len(ranked)
            self.high = ranked[min(len(ranked) - 1, int(self._quantile * len(ranked)))]


class RateEstimator:
    """Events per second as an exponentially decaying count: O(1) per event, no arrays.

    `tau_s` is the memory: a step in traffic is 63% followed after `tau_s` seconds.
    """

    __slots__ = ("tau_s", "value", "last")

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self.value = 0.0
        self.last: float | None = None

    def add(self, now: float, amount: float = 1.0) -> None:
        if self.last is not None and now > self.last:
            self.value *= math.exp((self.last - now) / self.tau_s)
        if self.last is None or now > self.last:
            self.last = now
        self.value += amount / self.tau_s

    def rate(self, now: float) -> float:
        if self.last is None or now <= self.last:
            return self.value
        return self.value * math.exp((self.last - now) / self.tau_s)
