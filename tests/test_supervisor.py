"""The supervisor's restart rule: at once after a long life, backing off in a crash loop."""

from __future__ import annotations

from batchserve.api.supervisor import Child
from batchserve.runner.timeouts import Timeouts

TIMEOUTS = Timeouts()
STABLE_S = TIMEOUTS.stable_s


def child_started_at(when: float) -> Child:
    return Child("runner m[0]", ["true"], {}, started=when)


def test_restart_pauses_double_and_are_capped() -> None:
    pauses = [TIMEOUTS.restart_pause(n) for n in range(9)]
    assert pauses == [0.0, 0.5, 1, 2, 4, 8, 16, 30, 30]


def test_restart_pauses_follow_the_configured_timeouts() -> None:
    timeouts = Timeouts(restart_first_s=2.0, restart_max_s=5.0)
    assert [timeouts.restart_pause(n) for n in range(5)] == [0.0, 2.0, 4.0, 5.0, 5.0]


def test_a_child_that_lived_long_is_restarted_at_once() -> None:
    child = child_started_at(0.0)
    assert child.due(STABLE_S + 1, TIMEOUTS)
    assert child.failures == 0


def test_early_deaths_in_a_row_back_off_and_a_long_life_resets() -> None:
    child = child_started_at(0.0)
    assert not child.due(1.0, TIMEOUTS)  # died after 1 s: first early death, wait 0.5 s
    assert child.due(1.5, TIMEOUTS)
    child.died, child.started = None, 1.5  # what start() leaves behind
    assert not child.due(2.0, TIMEOUTS)  # second early death: wait 1 s
    assert not child.due(2.9, TIMEOUTS) and child.due(3.0, TIMEOUTS)
    child.died, child.started = None, 3.0
    assert child.due(3.0 + STABLE_S, TIMEOUTS) and child.failures == 0
