"""The time kept back for an answer's way home follows the recent ways home, within bounds."""

from __future__ import annotations

import math

import pytest

from batchserve.api.reserve import EVERY, MOST, WINDOW, Reserve


def test_answers_that_all_left_early_still_teach_the_way_home() -> None:
    reserve = Reserve()
    for _ in range(WINDOW):
        # Each left 10 ms before the runner's deadline, its batch having ended 12 ms before
        # it: 2 ms on the way home, which a request served at the edge would be late by.
        reserve.answered(-0.010, 0.012)
    assert reserve.seconds(0.050) == pytest.approx(0.002)


def test_nothing_is_kept_back_for_answers_that_take_no_time_home() -> None:
    reserve = Reserve()
    for _ in range(WINDOW):
        reserve.answered(-0.010, 0.010)
    assert reserve.seconds(0.050) == 0.0


def test_a_batch_that_ended_late_counts_with_its_lateness() -> None:
    reserve = Reserve()
    for _ in range(WINDOW):
        reserve.answered(0.004, -0.003)  # the batch ended 3 ms late; its answer left 4 ms late
    assert reserve.seconds(0.050) == pytest.approx(0.004)


def test_a_spare_that_is_no_number_teaches_nothing() -> None:
    reserve = Reserve()
    for _ in range(WINDOW):
        reserve.answered(-0.010, 0.012)
    for spare_s in [math.nan, math.inf] * (WINDOW // 2):  # a peer's bad frames
        reserve.answered(-0.010, spare_s)
    assert reserve.seconds(0.050) == pytest.approx(0.002)


def test_the_reserve_is_the_99th_percentile_of_recent_ways_home_at_most_a_quarter() -> None:
    reserve = Reserve()
    ways = [0.001] * (WINDOW - 40) + [0.004] * 40  # 2% of answers 4 ms home, the rest 1 ms
    for way in ways:
        reserve.answered(way, 0.0)
    assert reserve.seconds(0.050) == pytest.approx(0.004)
    assert reserve.seconds(0.010) == pytest.approx(MOST * 0.010)  # never more than a quarter
    for way in [0.001] * (WINDOW - 10) + [0.004] * 10:  # 0.5% of them: within the quantile
        reserve.answered(way, 0.0)
    assert reserve.seconds(0.050) == pytest.approx(0.001)


LIMIT_S = 1e6
"""A limit whose quarter stays far above every way home below, out of the way."""


def test_the_estimate_moves_every_few_answers_and_forgets_old_ones() -> None:
    # "Every few": at 256 the estimate is a fraction of a second old under load; waiting for
    # many more answers would leave the reserve behind a change in overruns.
    assert EVERY <= 256
    reserve = Reserve()
    answers = EVERY * (WINDOW // EVERY + 2)  # past a full window, ending on a re-estimate
    estimates = [reserve.seconds(LIMIT_S)]
    for n in range(1, answers + 1):
        reserve.answered(n * 1e-6, 0.0)  # each longer than the last: each estimate is higher
        estimates.append(reserve.seconds(LIMIT_S))
    moved = [n for n in range(1, answers + 1) if estimates[n] != estimates[n - 1]]
    assert moved == list(range(EVERY, answers + 1, EVERY))
    assert estimates[EVERY - 1] == 0.0 and estimates[EVERY] > 0.0

    for _ in range(WINDOW - EVERY):
        reserve.answered(0.0, 0.0)  # answers with no way home
    assert reserve.seconds(LIMIT_S) > 0.0  # the long ways home still in the window count
    on_time = EVERY * math.ceil(WINDOW / EVERY)  # a window of them, ending on a re-estimate
    for _ in range(on_time - (WINDOW - EVERY)):
        reserve.answered(0.0, 0.0)
    assert reserve.seconds(LIMIT_S) == 0.0  # the long ways home are forgotten
