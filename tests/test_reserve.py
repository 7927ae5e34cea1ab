"""The time kept back for an answer's way home follows the recent overruns, within bounds."""

from __future__ import annotations

import pytest

from batchserve.api.reserve import EVERY, MOST, WINDOW, Reserve


def test_nothing_is_kept_back_until_answers_overrun() -> None:
    reserve = Reserve()
    for _ in range(WINDOW):
        reserve.observe(-0.010)  # answers left 10 ms before the runner's deadline
    assert reserve.seconds(0.050) == 0.0


def test_the_reserve_is_the_99_8th_percentile_of_recent_overruns_at_most_a_quarter() -> None:
    reserve = Reserve()
    overruns = [0.001] * (WINDOW - 8) + [0.004] * 8  # 0.4% of answers 4 ms late, the rest 1 ms
    for overrun in overruns:
        reserve.observe(overrun)
    assert reserve.seconds(0.050) == pytest.approx(0.004)
    assert reserve.seconds(0.010) == pytest.approx(MOST * 0.010)  # never more than a quarter
    for overrun in [0.001] * (WINDOW - 2) + [0.004] * 2:  # 0.1% late: within the quantile
        reserve.observe(overrun)
    assert reserve.seconds(0.050) == pytest.approx(0.001)


def test_the_estimate_moves_every_few_answers_and_forgets_old_ones() -> None:
    reserve = Reserve()
    for _ in range(WINDOW):
        reserve.observe(0.005)
    assert reserve.seconds(1.0) == pytest.approx(0.005)
    for _ in range(EVERY - 1):
        reserve.observe(0.0)
    assert reserve.seconds(1.0) == pytest.approx(0.005)  # not yet re-estimated
    for _ in range(WINDOW):
        reserve.observe(0.0)
    assert reserve.seconds(1.0) == 0.0
