"""The latency model recovers known lines from noisy batches, at low load too."""

from __future__ import annotations

import random

import pytest

from batchserve.runner.policy.latency_model import (
    Fit,
    LatencyModel,
    RateEstimator,
    Timing,
    fit_samples,
)
from batchserve.runner.policy.tuning import Tuning

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
    model = LatencyModel(Tuning(sample_window=128, half_life=16))
    for _ in range(96):
        rows = rng.randint(1, 64)
        add(model, rows, batch_time(rows, rng))
    for _ in range(32):
        rows = rng.randint(1, 64)
        add(model, rows, 2.0 * batch_time(rows, rng))
    fit = fit_samples(model.snapshot())
    assert fit.slope_s == pytest.approx(2 * SLOPE_S, rel=0.15)


def test_snapshot_weights_halve_every_half_life() -> None:
    model = LatencyModel(Tuning(half_life=2, calibration_weight=0.25))
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


def test_contention_that_comes_with_large_batches_does_not_tilt_the_cost_curve() -> None:
    episodes = _episodes(random.Random(6))
    model = calibrated(random.Random(6))
    for rows, wall, cpu in episodes:
        model.add(rows, wall, cpu)
    fit = fit_samples(model.snapshot())
    assert fit.cost(1) == pytest.approx(INTERCEPT_S + SLOPE_S, rel=0.1)
    assert fit.slope_s / fit.stretch == pytest.approx(SLOPE_S, rel=0.1)
    assert fit.stretch > 1.5  # what requests feel is carried by the stretch
    # A line through the wall times, as fitted before, takes the episodes for cost per row:
    wall = LatencyModel()
    for rows, seconds, _ in episodes:
        add(wall, rows, seconds)
    assert fit_samples(wall.snapshot()).slope_s > 2 * SLOPE_S


def _episodes(rng: random.Random) -> list[tuple[int, float, float]]:
    """Batches (rows, wall, CPU) on shared cores, confounded as seen live: in a slow episode
    batches are both larger (more requests queued behind the last one) and slower in wall
    time; their CPU time is the model's own cost whatever the episode."""
    out = []
    for i in range(128):
        slow = (i // 10) % 2 == 1
        rows = rng.randint(30, 60) if slow else rng.randint(1, 10)
        cpu = batch_time(rows, rng)
        out.append((rows, cpu * (4.5 if slow else 1.5), cpu))
    return out


def with_stalls(model: LatencyModel, rng: random.Random, count: int,
                stalls: dict[int, float]) -> None:
    """`count` batches of 8 rows; batch `i` stalls `stalls[i]` seconds of wall time, not CPU."""
    for i in range(count):
        cpu = batch_time(8, rng)
        model.add(8, cpu + stalls.get(i, 0.0), cpu)


def refit(model: LatencyModel) -> Fit:
    model.fit = fit_samples(model.snapshot())
    return model.fit


def test_after_a_slowdown_ends_the_model_comes_back_within_a_bounded_number_of_batches() -> None:
    rng = random.Random(7)
    model = calibrated(rng)
    refit(model)
    for _ in range(64):  # contention: wall time 3x the cost
        cpu = batch_time(8, rng)
        model.add(8, 3.0 * cpu, cpu)
    assert refit(model).stretch == pytest.approx(3.0, rel=0.1)
    shifted = 0
    for _ in range(8):  # the cores are free again
        cpu = batch_time(8, rng)
        shifted += model.add(8, cpu, cpu)
    assert shifted >= 1  # three fast batches in a row: a shift, a refit is due at once
    fit = refit(model)
    assert fit.stretch == pytest.approx(1.0, rel=0.1)
    assert fit.mean(8) == pytest.approx(INTERCEPT_S + SLOPE_S * 8, rel=0.1)


def test_a_burst_of_stalls_moves_the_stretch_a_bounded_step() -> None:
    rng = random.Random(8)
    model = calibrated(rng)
    before = refit(model).stretch
    for _ in range(3):  # three 200 ms stalls in a row on a 10 ms batch
        cpu = batch_time(10, rng)
        model.add(10, cpu + 0.2, cpu)
    after = refit(model).stretch
    assert after == pytest.approx(before * 4.0)  # 20-fold in truth, 4-fold at most per refit


def test_a_cost_shift_in_cpu_time_rescales_the_calibration_both_ways() -> None:
    rng = random.Random(9)
    model = calibrated(rng)
    refit(model)
    for _ in range(3):
        cpu = 2.0 * batch_time(16, rng)
        model.add(16, cpu, cpu)
    fit = refit(model)
    assert fit.cost(64) == pytest.approx(2.0 * (INTERCEPT_S + SLOPE_S * 64), rel=0.1)
    for _ in range(3):
        cpu = batch_time(16, rng)
        model.add(16, cpu, cpu)
    fit = refit(model)
    assert fit.cost(64) == pytest.approx(INTERCEPT_S + SLOPE_S * 64, rel=0.1)


def test_a_model_that_waits_is_measured_in_wall_time() -> None:
    model = LatencyModel()
    model.calibrate([Timing(rows, 0.3, 0.0001) for rows in (1, 2, 4, 8) * 2])  # a 300 ms sleep
    assert not model.cpu_bound
    fit = refit(model)
    assert fit.cost(1) == pytest.approx(0.3, rel=0.01)
    assert fit.stretch == pytest.approx(1.0)


def test_contention_while_calibrating_sets_neither_the_stretch_nor_the_tail() -> None:
    """Timed while other runners calibrate on the same cores, some calibration batches take
    several times their CPU time; the server then serves on cores of its own."""
    rng = random.Random(11)
    model = LatencyModel()
    timings = []
    for i, rows in enumerate((1, 2, 4, 8, 16) * 2):
        cpu = batch_time(rows, rng)
        timings.append(Timing(rows, cpu * (3.5 if i % 3 == 0 else 1.2), cpu))
    model.calibrate(timings)
    fit = refit(model)
    assert model.cpu_bound
    assert fit.stretch == pytest.approx(1.0, rel=0.1)
    assert fit.factor < 1.5
    assert fit.high(1) < 1.5 * (INTERCEPT_S + SLOPE_S)


def test_calibration_that_scattered_is_not_the_tail_once_a_few_live_batches_came() -> None:
    """Two of fourteen calibration batches, timed while the other runners calibrated, cost
    two and a half times the line. Read as the tail of a runner just started, they made
    every promise two and a half batch times long, and an API worker refused one request in
    four at 3 images a second on the backlog that runner published; once a few live batches
    came (`Tuning.few_recent`), the tail is theirs."""
    rng = random.Random(16)
    model = LatencyModel()
    timings = []
    for i, rows in enumerate((1, 2, 4, 8, 16, 32, 64) * 2):
        cpu = batch_time(rows, rng) * (2.5 if i in (3, 9) else 1.0)
        timings.append(Timing(rows, cpu, cpu))
    model.calibrate(timings)
    refit(model)
    for _ in range(Tuning().few_recent):
        add(model, 8, batch_time(8, rng))
    fit = refit(model)
    assert fit.factor < 1.3
    assert fit.high(8) < 1.3 * (INTERCEPT_S + SLOPE_S * 8)


def test_calibration_that_scattered_leaves_the_tail_once_live_batches_hold_a_p99() -> None:
    """Timed while other runners calibrate on the same cores, a model on two threads spins:
    a third of its calibration batches cost two and a half times the line. Those few costs
    must not stay the 99th percentile of a window that live batches, steady ones, have
    filled to hundreds: the tail read there doubled every promise of a ResNet."""
    rng = random.Random(15)
    model = LatencyModel()
    timings = []
    for i, rows in enumerate((1, 2, 4, 8, 16, 32, 64) * 2):
        cpu = batch_time(rows, rng) * (2.5 if i % 3 == 0 else 1.0)
        timings.append(Timing(rows, cpu, cpu))
    model.calibrate(timings)
    refit(model)
    for _ in range(300):
        add(model, 8, batch_time(8, rng))
        if _ % 25 == 0:
            refit(model)
    fit = refit(model)
    assert fit.tail < 1.3  # the live batches' own p99 over their median: about 1.1
    assert fit.high(8) < 1.3 * (INTERCEPT_S + SLOPE_S * 8)


def test_the_calibration_leaves_the_stretchs_window_once_a_hundred_live_batches_came() -> None:
    """Until then it anchors the stretch (and, before a few live batches, the tail); after,
    the window is the live batches' alone, so its median and spread are theirs."""
    rng = random.Random(17)
    model = calibrated(rng)  # fourteen calibration batches
    live = Tuning().tail_samples
    for _ in range(live - 1):
        add(model, 8, batch_time(8, rng))
    snapshot = model.snapshot()
    assert snapshot.seeds == 14 and len(snapshot.recent_rows) == 14 + live - 1
    add(model, 8, batch_time(8, rng))
    snapshot = model.snapshot()
    assert snapshot.seeds == 0 and snapshot.recent_rows == (8,) * live


def test_the_tail_factor_covers_a_heavy_tail_the_mad_would_miss() -> None:
    rng = random.Random(10)
    model = calibrated(rng)
    for i in range(256):  # 3% of batches take 3x: beyond what a normal law with this MAD says
        cpu = batch_time(8, rng)
        model.add(8, cpu * (3.0 if i % 33 == 0 else 1.0), cpu)
    fit = refit(model)
    walls = [batch_time(8, rng) * (3.0 if rng.random() < 0.03 else 1.0) for _ in range(20000)]
    covered = sum(wall <= fit.high(8) for wall in walls) / len(walls)
    assert covered >= 0.985


def test_three_rare_stalls_close_together_do_not_become_the_tail() -> None:
    rng = random.Random(11)
    model = calibrated(rng)
    # 200 ms stalls, three in the last 124 batches: chance, not contention
    with_stalls(model, rng, 1024, {900: 0.2, 950: 0.2, 1000: 0.2})
    fit = refit(model)
    # The tail stays the normal noise's; a stall in flight is the stall rule's (adaptive.py).
    # Read from the last 256 batches alone, the p99 was a stall: a factor of about 20.
    assert fit.factor < 1.5


def test_a_fit_keeps_the_longest_recent_overruns_a_stall_is_judged_by() -> None:
    rng = random.Random(12)
    model = calibrated(rng)
    with_stalls(model, rng, 200, {100: 0.2})
    fit = refit(model)
    assert len(fit.overruns) == 8
    assert list(fit.overruns) == sorted(fit.overruns)
    assert fit.overruns[-1] == pytest.approx(0.2, rel=0.05)  # the stall, in seconds past the mean
    assert fit.overruns[-2] < 0.002  # the rest is noise on a 9 ms batch


def test_one_hiccup_among_the_first_batches_is_not_read_as_their_p99() -> None:
    # Fewer than a hundred recent batches hold no 99th percentile: their largest is a single
    # hiccup (a page fault, a descheduled thread), here 150 ms on a 9 ms batch. Read as the
    # tail, it made every promise 16 batch times long and refused requests a server just
    # started could serve (a closed-loop client got a 503 with eight clients in flight).
    rng = random.Random(13)
    model = calibrated(rng)
    with_stalls(model, rng, 60, {30: 0.15})
    for _ in range(5):  # refits while the hundred batches a p99 needs are not in yet
        fit = refit(model)
    assert fit.factor <= 1.0 * Tuning().max_move  # the calibration's tail, moved at most once
    assert fit.overruns[-1] == pytest.approx(0.15, rel=0.05)  # the stall rule still sees it


def test_the_tail_is_read_once_a_hundred_batches_hold_a_p99() -> None:
    rng = random.Random(14)
    model = calibrated(rng)
    for i in range(300):  # contention: one batch in twenty runs four times as long
        cpu = batch_time(8, rng)
        model.add(8, cpu * (4.0 if i % 20 == 0 else 1.0), cpu)
    assert refit(model).factor > 3.0


def test_the_lines_error_is_shared_by_every_batch_a_promise_adds_up() -> None:
    fit = Fit(intercept_s=0.005, slope_s=0.0005, error=(1e-8, -1e-10, 4e-12))
    one = fit.line_error(1, 64)
    assert one == pytest.approx((1e-8 - 2 * 64 * 1e-10 + 64 * 64 * 4e-12) ** 0.5)
    assert fit.line_error(3, 192) == pytest.approx(3 * one)  # three like batches: 3x, not √3x
    assert Fit().line_error(4, 256) == 0.0


def after_a_load_step(seed: int, big: int) -> Fit:
    """Batches of a few rows, then `big` batches of 256 rows, as when the load triples."""
    rng = random.Random(seed)
    model = LatencyModel()
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256) * 2
    model.calibrate([Timing(n, t, t) for n in sizes for t in [batch_time(n, rng)]])
    for _ in range(128 - big):
        rows = rng.randint(2, 12)
        add(model, rows, batch_time(rows, rng))
    for _ in range(big):
        add(model, 256, batch_time(256, rng))
    return fit_samples(model.snapshot())


def test_the_lines_error_is_what_its_mean_misses_by_after_a_load_step() -> None:
    # A slope resting on a few large batches errs by a few percent; the error the fit
    # reports is what it misses by, neither a small share of it nor many times it.
    true = INTERCEPT_S + SLOPE_S * 256
    scores = []
    for seed in range(300):
        fit = after_a_load_step(seed, big=4)
        scores.append((fit.mean(256) - true) / fit.line_error(1, 256))
    spread = (sum(z * z for z in scores) / len(scores)) ** 0.5
    assert 0.7 < spread < 1.4
    assert sum(abs(z) > 3.5 for z in scores) <= 3


def test_the_lines_error_shrinks_as_batches_of_a_size_come() -> None:
    few, many = after_a_load_step(7, big=4), after_a_load_step(7, big=64)
    assert few.line_error(1, 256) > 2.0 * many.line_error(1, 256)
    assert many.line_error(1, 256) < 0.01 * many.mean(256)
