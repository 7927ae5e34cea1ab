"""The supervisor's restart rule: at once after a long life, backing off in a crash loop."""

from __future__ import annotations

from batchserve.api.supervisor import STABLE_S, Child, restart_pause


def child_started_at(when: float) -> Child:
    return Child("runner m[0]", ["true"], {}, started=when)


def test_restart_pauses_double_and_are_capped() -> None:
    assert [restart_pause(n) for n in range(9)] == [0.0, 0.5, 1, 2, 4, 8, 16, 30, 30]


def test_a_child_that_lived_long_is_restarted_at_once() -> None:
    child = child_started_at(0.0)
    assert child.due(STABLE_S + 1)
    assert child.failures == 0


def test_early_deaths_in_a_row_back_off_and_a_long_life_resets() -> None:
    child = child_started_at(0.0)
    assert not child.due(1.0)  # died after 1 s: first early death, wait 0.5 s
    assert child.due(1.5)
    child.died, child.started = None, 1.5  # what start() leaves behind
    assert not child.due(2.0)  # second early death: wait 1 s
    assert not child.due(2.9) and child.due(3.0)
    child.died, child.started = None, 3.0
    assert child.due(3.0 + STABLE_S) and child.failures == 0
