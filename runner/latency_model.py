"""The batch latency model: processing time as a line in batch rows, with a high quantile.

A policy asks two questions many times a second: how long will a batch of `n` rows take on
average (to decide whether waiting pays), and how long may it take in the bad case (to promise
deadlines). Both are answered from a `Fit`, a frozen value of four floats, so the hot path does a
multiply and an add. The fit itself (scikit-learn, a few milliseconds) runs on a snapshot of
samples, off the request's critical path: see `fit_samples` and docs/dispatcher.md.

Why each choice:
- A Huber fit, not plain least squares: one batch delayed by a GC pause or a noisy neighbour
  must not tilt the line (issue #3).
- Recency weights with a half-life counted in batches: after the cost of the model changes the
  line follows within a few dozen batches, while a quiet period does not erase the fit.
- Calibration samples (a few batch sizes timed on synthetic rows before the runner is ready) are
  kept for the life of the process with a small weight: at low load every live batch has one
  row, and without them slope and intercept could not be told apart (BentoML's failure).
- The high quantile is the mean times `1 + k * spread`, where spread is a robust (MAD) estimate
  of the relative residual: batch time noise is roughly multiplicative.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

MAD_TO_SIGMA = 1.4826  # scales a median absolute deviation to a normal standard deviation
HUBER_EPSILON = 1.345  # residuals beyond this many sigmas count linearly, not squared
HUBER_ROUNDS = 4


@dataclass(frozen=True, slots=True)
class Fit:
    """Batch time in seconds: mean(n) = intercept + slope * n; high(n) = mean(n) * factor."""

    intercept_s: float = 0.0
    slope_s: float = 0.0
    spread: float = 0.0
    factor: float = 1.0
    samples: int = 0

    def mean(self, rows: int) -> float:
        return self.intercept_s + self.slope_s * rows

    def high(self, rows: int) -> float:
        return (self.intercept_s + self.slope_s * rows) * self.factor


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The inputs of one refit, copied so the fit can run on another thread."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    weights: tuple[float, ...]
    quantile_k: float
    min_spread: float


class LatencyModel:
    """A sliding window of measured batches plus the calibration samples, and the current fit.

    Owns no clock: samples are ordered by arrival, and recency is counted in batches.
    """

    def __init__(
        self,
        *,
        window: int = 128,
        half_life: float = 32.0,
        calibration_weight: float = 0.1,
        quantile_k: float = 3.0,
        min_spread: float = 0.01,
    ) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.calibration: list[tuple[int, float]] = []
        self.half_life = half_life
        self.calibration_weight = calibration_weight
        self.quantile_k = quantile_k
        self.min_spread = min_spread
        self.fit = Fit()

    def add(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))

    def add_calibration(self, rows: int, seconds: float) -> None:
        self.calibration.append((rows, seconds))

    def restart(self, keep_last: int, slowdown: float) -> None:
        """The cost changed: drop all but the newest live samples, which old ones would now
        contradict, and scale the calibration by the slowdown those newest ones show.

        Unscaled, the calibration would pull the next fit halfway back to the old cost and
        the residual spread, hence every promise, would balloon until the window refills.
        """
        while len(self.samples) > keep_last:
            self.samples.popleft()
        self.calibration = [(rows, seconds * slowdown) for rows, seconds in self.calibration]

    def snapshot(self) -> Snapshot:
        live = list(self.samples)
        decay = 0.5 ** (1.0 / self.half_life)
        count = len(live)
        weights = [decay ** (count - 1 - i) for i in range(count)]
        weights += [self.calibration_weight] * len(self.calibration)
        every = live + self.calibration
        return Snapshot(
            rows=tuple(rows for rows, _ in every),
            seconds=tuple(seconds for _, seconds in every),
            weights=tuple(weights),
            quantile_k=self.quantile_k,
            min_spread=self.min_spread,
        )


def fit_samples(snapshot: Snapshot) -> Fit:
    """Fit mean and high quantile of batch time on rows; pure, safe to run on any thread."""
    if not snapshot.rows:
        return Fit()
    rows = np.asarray(snapshot.rows, dtype=float)
    millis = np.asarray(snapshot.seconds, dtype=float) * 1000.0  # Huber's tolerances like ms
    weights = np.asarray(snapshot.weights, dtype=float)
    intercept, slope = _line(rows, millis, weights)
    predicted = np.maximum(intercept + slope * rows, 1e-9)
    spread = max(_robust_spread(millis / predicted - 1.0, weights), snapshot.min_spread)
    return Fit(
        intercept_s=intercept / 1000.0,
        slope_s=slope / 1000.0,
        spread=spread,
        factor=1.0 + snapshot.quantile_k * spread,
        samples=len(snapshot.rows),
    )


def _line(rows: np.ndarray, millis: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """Intercept and slope (ms, ms/row), both kept non-negative."""
    if np.unique(rows).size < 2:
        # One size only (no calibration): a line through the origin is the cautious guess, as
        # it over-predicts larger batches; the cap stays small until larger sizes are seen.
        mean = float(np.average(millis / rows, weights=weights))
        return 0.0, mean
    intercept, slope = _huber(rows, millis, weights)
    if slope < 0.0:
        return float(np.average(millis, weights=weights)), 0.0
    if intercept < 0.0:
        return 0.0, _through_origin(rows, millis, weights)
    return intercept, slope


def _through_origin(rows: np.ndarray, millis: np.ndarray, weights: np.ndarray) -> float:
    return float(np.sum(weights * rows * millis) / np.sum(weights * rows * rows))


def _huber(rows: np.ndarray, millis: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """A Huber M-estimate by iteratively reweighted least squares.

    scikit-learn's `HuberRegressor` does the same job through L-BFGS and costs ~80 ms here;
    four weighted `LinearRegression` solves cost ~3 ms and give the same line.
    """
    from sklearn.linear_model import LinearRegression

    features = rows.reshape(-1, 1)
    model = LinearRegression()
    robust = np.ones_like(weights)
    for _ in range(HUBER_ROUNDS):
        model.fit(features, millis, sample_weight=weights * robust)
        residual = millis - model.predict(features)
        scale = MAD_TO_SIGMA * _weighted_median(np.abs(residual), weights)
        if scale <= 0.0:
            break
        robust = np.minimum(1.0, HUBER_EPSILON * scale / np.maximum(np.abs(residual), 1e-12))
    return float(model.intercept_), float(model.coef_[0])


def _robust_spread(relative: np.ndarray, weights: np.ndarray) -> float:
    """A weighted MAD of relative residuals, scaled to a normal sigma."""
    centre = _weighted_median(relative, weights)
    return MAD_TO_SIGMA * _weighted_median(np.abs(relative - centre), weights)


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    index = int(np.searchsorted(cumulative, cumulative[-1] / 2.0))
    return float(values[order][min(index, values.size - 1)])


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
