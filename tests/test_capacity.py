"""The capacity gauge's arithmetic, on fixed fits and fake clocks: what bounds it (the model
within the limit, or the cores the server's requests cost), and what a runner process and an
API worker measure for it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from batchserve.api.service import FrontCost
from batchserve.runner.load import LONGEST_SPAN_S, MIN_REQUESTS, LoadMeter, per_batch_s
from batchserve.runner.policy.capacity import Load, batch_within, capacity
from batchserve.runner.policy.latency_model import Fit
from batchserve.runner.server import _local
from benchmarks.capacity import (
    Check,
    ServerCost,
    Trial,
    front_ms,
    markdown,
    sweep,
    verdicts,
)
from benchmarks.live_clients import RunResult

# 2 ms a batch plus 0.1 ms a row; the high quantile 1.5x the mean.
FIT = Fit(intercept_s=0.002, slope_s=0.0001, factor=1.5, samples=50)
IDLE_CORES = Load(rows_per_request=1.0, front_s=0.0, loop_s=0.0, used_cores=0.0,
                  idle_cores=2.0, cores=2.0)


def test_the_largest_batch_within_half_the_limit_at_the_high_quantile() -> None:
    # 50 ms / 1.5 = 33.3 ms: (33.3 - 2) / 0.1 = 313 rows, bounded by the cap.
    assert batch_within(FIT, 0.1, 64) == 64
    assert batch_within(FIT, 0.1, 1000) == 313
    assert batch_within(FIT, 0.004, 64) == 1  # not even one row fits: one at a time


def test_with_cores_to_spare_the_model_bounds_it() -> None:
    # 64 rows in 2 + 6.4 ms, back to back.
    assert capacity(FIT, 0.1, 64, IDLE_CORES) == pytest.approx(64 / 0.0084)


def test_a_tighter_limit_means_smaller_batches_and_less_capacity() -> None:
    loose, tight = capacity(FIT, 0.1, 1000, IDLE_CORES), capacity(FIT, 0.02, 1000, IDLE_CORES)
    rows = batch_within(FIT, 0.02, 1000)
    assert tight == pytest.approx(rows / FIT.mean(rows))
    assert tight < loose


def test_what_each_request_costs_outside_the_model_bounds_it_on_few_cores() -> None:
    load = Load(rows_per_request=1.0, front_s=0.0004, loop_s=0.0001, used_cores=0.5,
                idle_cores=0.5, cores=2.0)
    model_s = FIT.curve(64) / 64
    assert capacity(FIT, 0.1, 64, load) == pytest.approx(1.0 / (0.0005 + model_s))
    dearer = Load(rows_per_request=1.0, front_s=0.0008, loop_s=0.0001, used_cores=0.5,
                  idle_cores=0.5, cores=2.0)
    assert capacity(FIT, 0.1, 64, dearer) < capacity(FIT, 0.1, 64, load)


def test_a_model_on_more_threads_than_its_wall_time_pays_its_cpu_curve() -> None:
    """A model on two threads spends about twice its wall time in CPU: its cost curve (fitted
    on CPU time) over its wall time, the stretch, is 0.5. The cores pay the curve."""
    two_threads = Fit(intercept_s=0.002, slope_s=0.0001, factor=1.5, samples=50, stretch=0.5)
    load = Load(rows_per_request=1.0, front_s=0.0004, loop_s=0.0001, used_cores=0.5,
                idle_cores=0.5, cores=2.0)
    model_s = 2 * two_threads.mean(64) / 64
    assert capacity(two_threads, 0.1, 64, load) == pytest.approx(1.0 / (0.0005 + model_s))


def test_what_every_batch_costs_is_priced_in_the_batches_run_at_capacity() -> None:
    """0.9 ms a request outside the model now, in batches of two requests, of which 0.8 ms
    is a batch's (0.4 ms a request): at capacity the batches hold 64, so a request costs
    0.5 + 0.8 / 64 ms there."""
    now = Load(rows_per_request=1.0, front_s=0.0006, loop_s=0.0003, used_cores=0.5,
               idle_cores=0.5, cores=2.0, batches_per_request=0.5, batch_s=0.0008)
    model_s = FIT.curve(64) / 64
    expected = 1.0 / (0.0005 + 0.0008 / 64 + model_s)
    assert capacity(FIT, 0.1, 64, now) == pytest.approx(expected)
    unknown = Load(rows_per_request=1.0, front_s=0.0006, loop_s=0.0003, used_cores=0.5,
                   idle_cores=0.5, cores=2.0, batches_per_request=0.5)
    assert capacity(FIT, 0.1, 64, unknown) == pytest.approx(1.0 / (0.0009 + model_s))


def test_the_batch_cost_is_not_spread_over_larger_batches_than_were_seen() -> None:
    """Told apart on batches of 2 to 4 requests, the batch cost is spread over 4 at most."""
    seen = Load(rows_per_request=1.0, front_s=0.0006, loop_s=0.0003, used_cores=0.5,
                idle_cores=0.5, cores=2.0, batches_per_request=0.5, batch_s=0.0008,
                fewest_batches_per_request=0.25)
    model_s = FIT.curve(64) / 64
    expected = 1.0 / (0.0005 + 0.0008 / 4 + model_s)
    assert capacity(FIT, 0.1, 64, seen) == pytest.approx(expected)


def test_batches_larger_now_than_at_capacity_are_not_priced_up() -> None:
    big = Load(rows_per_request=1.0, front_s=0.0006, loop_s=0.0003, used_cores=0.5,
               idle_cores=0.5, cores=2.0, batches_per_request=0.01, batch_s=0.0008)
    model_s = FIT.curve(64) / 64
    assert capacity(FIT, 0.1, 64, big) == pytest.approx(1.0 / (0.0009 + model_s))


def test_a_batch_cost_is_the_slope_of_cost_on_batches_per_request() -> None:
    spans = [(1.0, 0.0012), (0.5, 0.0008), (0.1, 0.00048), (0.0625, 0.00045)]
    assert per_batch_s(spans) == pytest.approx(0.0008)
    assert per_batch_s(spans[:2]) == 0.0  # two spans: too few
    assert per_batch_s([(0.1, 0.0005), (0.2, 0.0004), (0.3, 0.0006)]) == 0.0  # too alike
    assert per_batch_s([(1.0, 0.0004), (0.5, 0.0006), (0.1, 0.0008)]) == 0.0  # falls: none


def test_the_meter_tells_the_batch_cost_apart_once_batches_differ() -> None:
    """Spans of one request a batch and of 20: the runner's loop costs 0.1 ms a request and
    0.5 ms a batch, the API worker 0.3 ms a request and 0.5 ms a batch."""
    clocks = Clocks()
    meter = clocks.meter()
    readings = []
    for per_batch in (1, 1, 20, 20, 20):
        batches = 100 // per_batch
        for _ in range(100):
            meter.offer(0.0003 + 0.0005 / per_batch)
        for _ in range(batches):
            meter.batch(per_batch, per_batch, 0.0)
        clocks.wall += 1.0
        clocks.cpu += 100 * 0.0001 + batches * 0.0005
        readings.append(meter.read())
    first, last = readings[0], readings[-1]
    assert first is not None and first.batch_s == 0.0  # one span: nothing told apart
    assert last is not None and last.batches_per_request == pytest.approx(0.05)
    assert last.batch_s == pytest.approx(0.001)
    assert last.fewest_batches_per_request == pytest.approx(0.05)
    assert last.front_s + last.loop_s == pytest.approx(0.0004 + 0.001 / 20)


def test_processes_of_one_runner_share_the_idle_cores_and_none_exceeds_its_own() -> None:
    one = Load(rows_per_request=1.0, front_s=0.001, loop_s=0.0, used_cores=0.2,
               idle_cores=1.0, cores=4.0)
    two = Load(rows_per_request=1.0, front_s=0.001, loop_s=0.0, used_cores=0.2,
               idle_cores=1.0, processes=2, cores=4.0)
    capped = Load(rows_per_request=1.0, front_s=0.001, loop_s=0.0, used_cores=0.2,
                  idle_cores=1.0, cores=0.5)
    per_request_s = 0.001 + FIT.curve(64) / 64
    assert capacity(FIT, 0.1, 64, one) == pytest.approx(1.2 / per_request_s)
    assert capacity(FIT, 0.1, 64, two) == pytest.approx(0.7 / per_request_s)
    assert capacity(FIT, 0.1, 64, capped) == pytest.approx(0.5 / per_request_s)


def test_requests_of_several_rows_count_as_many_rows() -> None:
    four = Load(rows_per_request=4.0, front_s=0.0, loop_s=0.0, used_cores=0.0,
                idle_cores=2.0, cores=2.0)
    assert capacity(FIT, 0.1, 64, four) == pytest.approx(capacity(FIT, 0.1, 64, IDLE_CORES) / 4)


def test_an_unfitted_model_says_nothing() -> None:
    assert capacity(Fit(), 0.1, 64, IDLE_CORES) == 0.0


class Clocks:
    """Wall, process CPU and machine idle seconds, moved by hand."""

    def __init__(self) -> None:
        self.wall = self.cpu = self.idle = 0.0

    def meter(self, processes: int = 1) -> LoadMeter:
        return LoadMeter(processes, lambda: self.wall, lambda: self.cpu, lambda: self.idle,
                         cores=2.0)


def test_a_load_reading_is_per_request_over_its_span() -> None:
    clocks = Clocks()
    meter = clocks.meter()
    for _ in range(100):
        meter.offer(0.0004)
    for _ in range(10):
        meter.batch(10, 10, 0.002)  # 100 requests, 20 ms of model CPU
    clocks.wall, clocks.cpu, clocks.idle = 1.0, 0.05, 1.5
    load = meter.read()
    assert load is not None
    assert load.rows_per_request == 1.0
    assert load.front_s == pytest.approx(0.0004)
    assert load.loop_s == pytest.approx((0.05 - 0.02) / 100)
    assert load.used_cores == pytest.approx(0.05 + 0.04)
    assert load.idle_cores == pytest.approx(1.5)


def test_a_span_with_too_few_requests_runs_on_without_reading_the_clocks() -> None:
    clocks = Clocks()
    meter = clocks.meter()
    meter.batch(MIN_REQUESTS - 1, MIN_REQUESTS - 1, 0.001)
    clocks.wall = math.nan  # read, it would poison the reading
    assert meter.read() is None
    clocks.wall = 2.0
    meter.batch(1, 1, 0.0)
    load = meter.read()
    assert load is not None and load.rows_per_request == 1.0


def test_a_span_that_held_a_pause_is_dropped_and_the_next_starts_after_it() -> None:
    clocks = Clocks()
    meter = clocks.meter()
    meter.batch(MIN_REQUESTS, MIN_REQUESTS, 0.0)
    clocks.wall, clocks.idle = LONGEST_SPAN_S + 5.0, 2 * (LONGEST_SPAN_S + 5.0)  # all idle
    assert meter.read() is None
    meter.batch(MIN_REQUESTS, MIN_REQUESTS, 0.0)
    clocks.wall += 1.0
    clocks.cpu += 0.5
    load = meter.read()
    assert load is not None
    assert load.idle_cores == 0.0 and load.used_cores == pytest.approx(0.5)


def test_without_a_machine_idle_clock_no_idle_core_is_counted() -> None:
    meter = LoadMeter(1, iter([0.0, 1.0]).__next__, lambda: 0.0, lambda: None, cores=2.0)
    meter.batch(MIN_REQUESTS, MIN_REQUESTS, 0.0)
    load = meter.read()
    assert load is not None and load.idle_cores == 0.0


def test_an_api_worker_reads_its_cpu_per_request_answered() -> None:
    cpu = iter([1.0, 1.02, 1.03])
    front = FrontCost(cpu.__next__)
    assert front.measure(FrontCost.MIN_REQUESTS - 1) is None  # too few: the clock is not read
    assert front.measure(100) == pytest.approx(0.02 / 100)
    assert front.measure(149) is None
    assert front.measure(200) == pytest.approx(0.01 / 100)


def test_only_an_api_worker_on_this_machine_counts_against_its_cores() -> None:
    assert _local("")  # a unix socket
    assert _local(("127.0.0.1", 5000)) and _local(("::1", 5000, 0, 0))
    assert not _local(("10.0.0.7", 5000))


# --- the live check's bookkeeping (benchmarks/capacity.py) -----------------------------------

def run_at(rate: float, p99_ms: float) -> RunResult:
    return RunResult(client="fake", rate=rate, seconds=1.0, sent=100, ok=100, refused=0,
                     other=0, p50_ms=1.0, p99_ms=p99_ms, refused_p99_ms=None,
                     send_lag_p99_ms=None, good=100, client_cpu_s=0.0, raw={})


class FakeClient:
    """Passes up to `limit` req/s; past it, p99 over the limit."""

    name = "fake"

    def __init__(self, limit: float, passes_again: float = math.inf,
                 hiccups: Sequence[bool] = ()) -> None:
        self.limit, self.passes_again, self.tried = limit, passes_again, []
        self.hiccups = list(hiccups)  # the first runs' outcomes, whatever the rate

    def run(self, url: str, rate: float, seconds: float, seed: int) -> RunResult:
        self.tried.append(rate)
        ok = rate <= self.limit or rate == self.passes_again
        if self.hiccups:
            ok = self.hiccups.pop(0)
        return run_at(rate, 20.0 if ok else 500.0)


def test_a_sweep_goes_on_past_one_failure_and_stops_after_two_then_halves_the_gap() -> None:
    client = FakeClient(2200, passes_again=2800)  # a noisy pass at 2,800
    runs = sweep(client, "", [1200, 1600, 2000, 2400, 2800, 3200, 3600, 4000], 1.0)
    # 2,800 passed by luck: the gap above it is closed (3,000), not the one the limit is in.
    assert client.tried == [1200, 1600, 2000, 2400, 2400, 2800, 3200, 3200, 3600, 3600, 3000,
                            3000]
    trial = Trial(2000.0, tuple(runs), planned=2640.0, client_ms=0.35)
    assert trial.passed_rate == 2800
    assert trial.failed is not None and trial.failed.rate == 3000


def test_a_rate_passes_when_most_of_its_runs_pass() -> None:
    # 1,200 fails once and passes twice; 1,600 fails twice; 2,000 passes at once.
    client = FakeClient(2000, hiccups=[False, True, True, False, False])
    runs = sweep(client, "", [1200, 1600, 2000, 2400, 2800], 1.0)
    assert client.tried == [1200, 1200, 1200, 1600, 1600, 2000, 2400, 2400, 2800, 2800, 2200,
                            2200]
    assert verdicts(runs) == {1200: True, 1600: False, 2000: True, 2400: False, 2800: False,
                              2200: False}
    trial = Trial(0.0, tuple(runs))
    assert trial.passed_rate == 2000
    assert trial.failed is not None and trial.failed.rate == 2200


def test_the_gap_is_halved_until_it_is_at_most_the_resolution() -> None:
    client = FakeClient(2300)
    runs = sweep(client, "", [1200, 1600, 2000, 2400, 2800], 1.0)
    # 2,200 to 2,400: close enough
    assert client.tried == [1200, 1600, 2000, 2400, 2400, 2800, 2800, 2200]
    assert Trial(0.0, tuple(runs)).passed_rate == 2200
    assert len(sweep(FakeClient(2300), "", [1200, 1600, 2000, 2400, 2800], 1.0,
                     resolution=100)) == 9  # and 2,300


def test_the_trials_are_judged_on_their_medians() -> None:
    def trial(capacity: float, limit: float, plan: float) -> Trial:
        runs = sweep(FakeClient(limit), "", [1200, 1600, 2000, 2400, 2800, 3200], 1.0)
        return Trial(capacity, tuple(runs), planned=plan, client_ms=0.35,
                     front_ms=plan / 5000.0 - 0.03)

    checked = Check("fake", 1, (trial(2100, 2000, 2500), trial(1900, 3200, 2300),
                                trial(2000, 2400, 2400)))
    assert checked.capacity == 2000 and checked.planned == 2400
    assert checked.passed_rate == 2400  # of 2,000, 3,200 and 2,400
    assert checked.against(checked.capacity) == pytest.approx(2000 / 2400)
    median = checked.median_trial
    assert median.passed_rate == 2400 and median.failed is not None
    assert median.failed.rate == 2600
    assert ("| fake | 1 | 2,000 | 2,400 | 2,400 (2,000, 3,200, 2,400) | 0.83 | 1.00 | 0.35 | "
            "0.45 | 2,600: 500 ms, - |" in markdown([checked]))


def test_a_sweep_where_nothing_passes_has_no_ratio() -> None:
    runs = sweep(FakeClient(0), "", [1, 2, 3], 1.0)
    checked = Check("fake", 2, (Trial(2000.0, tuple(runs)),))
    assert checked.passed_rate is None and checked.against(checked.capacity) is None
    assert ("| fake | 2 | 2,000 | none | none (none) | - | - | 0.00 | - | 1: 500 ms, - |"
            in markdown([checked]))


def test_the_plan_is_told_the_servers_cost_near_its_capacity_less_its_batches() -> None:
    costs = [ServerCost(1200, True, 1.0, 1000, 50),  # far below the top: not counted
             ServerCost(2400, True, 0.5, 2000, 100),
             ServerCost(2800, True, 0.6, 2000, 80),
             ServerCost(3200, False, 0.03, 3000, 10)]  # failed: its refusals cost little
    # (1,000 + 1,200 ms - 0.5 ms * 180 batches) / 4,000 requests
    assert front_ms(costs, batch_ms=0.5) == pytest.approx((2200.0 - 90.0) / 4000.0)
    assert front_ms(costs[3:]) is None
