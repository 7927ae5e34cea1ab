"""The latency model recovers known lines from noisy batches, at low load too (issue #3)."""

from __future__ import annotations

import random

import pytest

from runner.latency_model import Fit, LatencyModel, RateEstimator, Timing, fit_samples

INTERCEPT_S = 0.005
SLOPE_S = 0.0005


def batch_time(rows: int, rng: random.Random, noise: float = 0.05) -> float:
    return (INTERCEPT_S + SLOPE_S * rows) * rng.lognormvariate(0.0, noise)


def add(model: LatencyModel, rows: int, seconds: float) -> None:
    """A batch on an idle machine: its wall time is its CPU time."""
    model.add(rows, seconds, seconds)


def calibrated(rng: random.Random) -> LatencyModel:
    model = LatencyModel()
    times = [(rows, batch_time(rows, rng)) for rows in (1, 2, 4, 8, 16, 32, 64) * 2]
    model.calibrate([Timing(rows, seconds, seconds) for rows, seconds in times])
    return model


def test_recovers_coefficients_from_mixed_sizes() -> None:
    rng = random.Random(1)
    model = LatencyModel()
    for _ in range(128):
        rows = rng.randint(1, 64)
        add(model, rows, batch_time(rows, rng))
    fit = fit_samples(model.snapshot())
    assert fit.intercept_s == pytest.approx(INTERCEPT_S, rel=0.1)
    assert fit.slope_s == pytest.approx(SLOPE_S, rel=0.05)
    assert fit.spread == pytest.approx(0.05, rel=0.3)


def test_all_batches_of_one_are_well_posed_with_calibration() -> None:
    rng = random.Random(2)
    model = calibrated(rng)
    for _ in range(128):
        add(model, 1, batch_time(1, rng))
    fit = fit_samples(model.snapshot())
    assert fit.intercept_s == pytest.approx(INTERCEPT_S, rel=0.1)
    assert fit.slope_s == pytest.approx(SLOPE_S, rel=0.1)


def test_one_size_without_calibration_is_a_cautious_line_through_the_origin() -> None:
    model = LatencyModel()
    for _ in range(10):
        add(model, 1, 0.0055)
    fit = fit_samples(model.snapshot())
    assert fit.intercept_s == 0.0
    assert fit.slope_s == pytest.approx(0.0055)
    assert fit.mean(64) > INTERCEPT_S + SLOPE_S * 64  # over-predicts big batches, never under


def test_outliers_do_not_tilt_the_line() -> None:
    rng = random.Random(3)
    model = LatencyModel()
    for i in range(128):
        rows = rng.randint(1, 64)
        slow = 5.0 if i % 20 == 0 else 1.0  # a GC pause every 20 batches
        add(model, rows, batch_time(rows, rng) * slow)
    fit = fit_samples(model.snapshot())
    assert fit.intercept_s == pytest.approx(INTERCEPT_S, rel=0.15)
    assert fit.slope_s == pytest.approx(SLOPE_S, rel=0.1)


def test_high_quantile_covers_ninety_nine_percent() -> None:
    rng = random.Random(4)
    model = calibrated(rng)
    for _ in range(128):
        rows = rng.randint(1, 64)
        add(model, rows, batch_time(rows, rng))
    fit = fit_samples(model.snapshot())
    sizes = [rng.randint(1, 64) for _ in range(5000)]
    covered = sum(batch_time(rows, rng) <= fit.high(rows) for rows in sizes) / len(sizes)
    assert covered >= 0.99
    assert fit.high(10) > fit.mean(10)


def test_recent_batches_outweigh_old_ones_after_a_cost_change() -> None:
    rng = random.Random(5)
    model = LatencyModel(window=128, half_life=16)
    for _ in range(96):
        rows = rng.randint(1, 64)
        add(model, rows, batch_time(rows, rng))
    for _ in range(32):
        rows = rng.randint(1, 64)
        add(model, rows, 2.0 * batch_time(rows, rng))
    fit = fit_samples(model.snapshot())
    assert fit.slope_s == pytest.approx(2 * SLOPE_S, rel=0.15)


def test_snapshot_weights_halve_every_half_life() -> None:
    model = LatencyModel(half_life=2, calibration_weight=0.25)
    model.calibrate([Timing(8, 0.01, 0.01)])
    for rows in (1, 2, 3):
        add(model, rows, 0.01)
    snapshot = model.snapshot()
    assert snapshot.rows == (1, 2, 3, 8)
    assert snapshot.weights == pytest.approx((0.5, 2**-0.5, 1.0, 0.25))


def test_empty_snapshot_gives_an_empty_fit() -> None:
    assert fit_samples(LatencyModel().snapshot()) == Fit()


def test_rate_estimator_tracks_a_steady_rate_and_decays() -> None:
    rate = RateEstimator(tau_s=0.5)
    for i in range(2000):
        rate.add(i / 1000.0)  # 1,000 events per second for 2 s
    assert rate.rate(2.0) == pytest.approx(1000.0, rel=0.02)
    assert rate.rate(2.5) == pytest.approx(1000.0 / 2.718281828, rel=0.02)
