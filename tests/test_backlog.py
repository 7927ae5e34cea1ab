"""The API worker's refusals from a runner process's published backlog, on a fake clock."""

from __future__ import annotations

import pytest

from batchserve.api.backlog import Published
from batchserve.runner.core.wire import Backlog
from batchserve.runner.policy.adaptive import AdaptivePolicy
from batchserve.runner.policy.base import Request
from batchserve.runner.policy.latency_model import Timing


def test_a_published_wait_ages_as_the_clock_runs() -> None:
    backlog = Published()
    assert not backlog.refuses(0.0001, now=5.0)  # nothing heard yet: nothing refused here
    backlog.hear(Backlog(0.080, 12), now=10.0)
    assert backlog.left_s(10.0) == pytest.approx(0.080)
    assert backlog.refuses(0.050, now=10.0)
    assert backlog.refuses(0.050, now=10.020)  # 60 ms left
    assert not backlog.refuses(0.050, now=10.040)  # 40 ms left: the runner judges it
    assert backlog.left_s(11.0) == 0.0
    backlog.hear(Backlog(0.0, 0), now=12.0)  # a runner that refuses nothing on arrival
    assert not backlog.refuses(0.0, now=12.0)


def fitted_policy(refuse: str = "at_arrival") -> AdaptivePolicy:
    """A policy that knows its model: 2 ms a batch plus 1 ms a row, 100 ms limit."""
    policy = AdaptivePolicy(64, 0.100, refuse=refuse)  # type: ignore[arg-type]
    policy.calibrate([Timing(rows, 0.002 + 0.001 * rows, 0.002 + 0.001 * rows)
                      for rows in policy.calibration_sizes() for _ in range(3)])
    return policy


def busy_with(policy: AdaptivePolicy, rows: int, now: float) -> int:
    """Run one batch and queue `rows` one-row requests behind it; the next free id."""
    assert policy.offer(Request(0, 1, now, now + 0.1), now)
    assert policy.poll(now).batch is not None
    for ident in range(1, rows + 1):
        policy.offer(Request(ident, 1, now, now + 0.1), now)
    return rows + 1


@pytest.mark.parametrize("queued", [0, 20, 60, 120])
def test_what_the_published_wait_refuses_the_policy_refuses_too(queued: int) -> None:
    now = 1.0
    policy = fitted_policy()
    ident = busy_with(policy, queued, now)
    admission = policy.admission(now)
    assert admission.rows_ahead == policy.stats(now).queued + 1  # one row runs
    backlog = Published()
    backlog.hear(Backlog(admission.wait_s, admission.rows_ahead, admission.drain_s,
                         admission.row_s), now)
    later = now + 0.003  # heard 3 ms ago: the API worker's clock ran on
    for budget_s in (0.5 * admission.wait_s, 0.9 * admission.wait_s - 0.003):
        if budget_s <= 0.0:
            continue
        assert backlog.refuses(budget_s, later)
        ident += 1
        assert not policy.offer(Request(ident, 1, later, later + budget_s), later), (
            queued, budget_s, admission)
    # What it leaves to the runner, the runner may take: a budget well over the wait.
    assert not backlog.refuses(1.2 * admission.wait_s, later)


def test_an_idle_runner_and_one_that_refuses_the_oldest_publish_nothing_to_refuse_on() -> None:
    assert fitted_policy().admission(0.0).wait_s == 0.0
    oldest = fitted_policy("oldest")
    busy_with(oldest, 200, 1.0)
    assert oldest.admission(1.0).wait_s == 0.0


def test_each_row_refused_in_place_adds_to_the_retry_after_as_the_runner_counts_it() -> None:
    now = 1.0
    policy = fitted_policy()
    busy_with(policy, 120, now)
    admission = policy.admission(now)
    # The rows ahead, and those refused on the way here, which their clients bring back.
    assert policy.refused > 0
    assert admission.drain_s > policy.drain_s(admission.rows_ahead)
    backlog = Published()
    backlog.hear(Backlog(admission.wait_s, admission.rows_ahead, admission.drain_s,
                         admission.row_s), now)
    first = backlog.refuse(4)
    assert first == pytest.approx(admission.drain_s + 4 * admission.row_s)
    assert backlog.refuse(4) > first  # the refused work comes back: a later retry
    backlog.hear(Backlog(admission.wait_s, admission.rows_ahead, admission.drain_s,
                         admission.row_s), now + 0.01)
    assert backlog.refuse(4) == pytest.approx(first)  # the runner's next word counts anew


def test_rows_sent_since_the_word_beyond_the_next_batch_count_in_the_wait() -> None:
    # The policy caps its batches at 3 images where max_batch_size is 16: the fourth image
    # sent during a batch waits for a batch after the next one, and its runner refuses it
    # there, a batch late, if this worker lets it through.
    backlog = Published(full_batch=16)
    backlog.hear(Backlog(0.150, 1, 0.080, 0.030, next_rows=3), now=10.0)
    backlog.sent(3)  # the next batch takes these
    assert backlog.left_s(10.0) == pytest.approx(0.150)
    backlog.sent(2)
    assert backlog.left_s(10.0) == pytest.approx(0.150 + 2 * 0.030)
    assert backlog.refuses(0.200, now=10.0)
    backlog.hear(Backlog(0.150, 1, 0.080, 0.030), now=10.1)  # a word that does not say
    backlog.sent(5)
    assert backlog.left_s(10.1) == pytest.approx(0.150)  # a full batch of 16 may join


def test_rows_sent_since_the_word_beyond_a_full_batch_count_in_the_wait() -> None:
    backlog = Published(full_batch=8)
    backlog.hear(Backlog(0.050, 16, 0.080, 0.005), now=10.0)
    backlog.sent(8)  # a full batch may still join the one the word was for
    assert backlog.left_s(10.0) == pytest.approx(0.050)
    backlog.sent(11)
    assert backlog.left_s(10.0) == pytest.approx(0.050 + 11 * 0.005)
    assert backlog.refuses(0.100, now=10.0)
    assert not backlog.refuses(0.100, now=10.010)  # drained meanwhile
    backlog.hear(Backlog(0.050, 16, 0.080, 0.005), now=10.040)  # the next word counts anew
    assert backlog.left_s(10.040) == pytest.approx(0.050)
    idle = Published(full_batch=8)
    idle.hear(Backlog(0.0), now=10.0)  # a runner that refuses nothing on arrival
    idle.sent(100)
    assert not idle.refuses(0.0, now=10.0)


@pytest.mark.parametrize("queued", [0, 20, 60])
@pytest.mark.parametrize("sent", [10, 40, 100])
def test_what_the_wait_with_rows_sent_since_refuses_the_policy_refuses_too(
    queued: int, sent: int
) -> None:
    now = 1.0
    policy = fitted_policy()
    ident = busy_with(policy, queued, now)
    admission = policy.admission(now)
    backlog = Published(full_batch=policy.limits.max_batch_size)
    backlog.hear(Backlog(admission.wait_s, admission.rows_ahead, admission.drain_s,
                         admission.row_s, admission.request_rows, admission.next_rows), now)
    assert 0 < admission.next_rows <= policy.limits.max_batch_size
    later = now + 0.002
    for _ in range(sent):  # this worker's calls since the word, each taken or refused there
        ident += 1
        policy.offer(Request(ident, 1, later, later + 0.1), later)
        backlog.sent(1)
    left = backlog.left_s(later)
    refused = 0
    for budget_s in (0.3 * left, 0.6 * left, 0.95 * left - 0.002):
        if budget_s <= 0.0 or not backlog.refuses(budget_s, later):
            continue
        refused += 1
        ident += 1
        assert not policy.offer(Request(ident, 1, later, later + budget_s), later), (
            queued, sent, budget_s, left)
    assert refused or left == 0.0
