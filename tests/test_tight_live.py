"""How the live tight-limit check configures its server, orders its runs, and counts and
prints what a run measured (benchmarks/tight_live.py); no server, no clock."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from batchserve.api.bench.scrape import Scrape
from batchserve.runner.core.config import parse
from benchmarks.live_clients import RunResult, SharedClient, from_shared
from benchmarks.tight_live import (
    MODEL,
    Run,
    Server,
    config,
    late_at_server,
    plan,
    reasons,
    server_window,
    summary,
    table,
)
from tests.fixture_models import paced_rows

SHARED_LINE = {
    "sent": 6000, "ok": 4500, "n_503": 1480, "p50_ms": 8.2, "p99_ms": 13.4, "p99_503_ms": 3.1,
    "send_lag_p99_ms": 1.2, "good_frac": 0.7, "client_cpu_frac": 0.1, "wall_s": 20.0,
}


def result(**changes: object) -> RunResult:
    return replace(from_shared(SHARED_LINE, 300.0, 20.0), **changes)  # type: ignore[arg-type]


SERVER = Server(codes={"200": 4500.0, "503": 1480.0}, unavailable={"queue": 1400.0, "front": 80.0},
                rejections={"queue": 1400.0}, batches=4000, rows=4500,
                model={"intercept_s": 0.0052, "slope_s": 0.0005, "stretch": 1.0})


@pytest.mark.parametrize("mode", ["at_arrival", "oldest"])
def test_the_configuration_is_the_scenario_s_runner_in_the_mode_asked(mode: str) -> None:
    runner = parse(yaml.safe_load(config(mode)), Path(".")).runners[MODEL]  # type: ignore[arg-type]
    batching = runner.batching
    assert (batching.max_latency_ms, batching.max_batch_size, batching.refuse) == (12.0, 64, mode)
    assert runner.model == "fixture_models:paced_rows"
    assert [spec.shape for spec in runner.inputs] == [(-1, 256)]  # the shared client's rows


def test_the_model_answers_one_value_a_row() -> None:
    x = np.arange(6 * 256, dtype=np.float32).reshape(6, 256)
    assert paced_rows(x).tolist() == [[0.0], [256.0], [512.0], [768.0], [1024.0], [1280.0]]


def test_every_other_round_runs_the_modes_and_clients_in_reverse() -> None:
    assert plan(3) == [
        (1, "at_arrival", ("batchserve", "shared")), (1, "oldest", ("batchserve", "shared")),
        (2, "oldest", ("shared", "batchserve")), (2, "at_arrival", ("shared", "batchserve")),
        (3, "at_arrival", ("batchserve", "shared")), (3, "oldest", ("batchserve", "shared")),
    ]


def test_a_run_splits_what_was_sent_into_in_time_late_refused_and_other() -> None:
    run = Run("oldest", 1, result(), SERVER)
    assert (run.result.good, run.result.ok, run.result.refused, run.result.other) == (
        4200, 4500, 1480, 20)
    assert run.within == pytest.approx(0.7)
    assert run.late == pytest.approx(0.05)
    assert run.refused == pytest.approx(1480 / 6000)
    assert run.other == pytest.approx(20 / 6000)
    empty = Run("oldest", 1, result(sent=0, ok=0, good=0, refused=0, other=0), SERVER)
    assert (empty.within, empty.late, empty.refused, empty.other) == (None, None, None, None)


def test_a_row_prints_every_column() -> None:
    row = Run("at_arrival", 2, result(), SERVER).row()
    assert row == ("| at_arrival | shared | 2 | 6,000 | 70.0 | 5.0 | 24.7 | 0.3 | 3.10 | 8.20 | "
                   "13.40 | 1.20 | 1.1 | queue 1,400, front 80 |")
    assert table([Run("at_arrival", 2, result(), SERVER)]).splitlines()[2] == row


def test_reasons_come_largest_first_and_none_says_so() -> None:
    assert reasons({"front": 3.0, "queue": 4210.0, "expired": 3.0}) == (
        "queue 4,210, expired 3, front 3")
    assert reasons({}) == "none"


def test_the_summary_gives_each_round_and_the_mean_per_mode_and_client() -> None:
    runs = [Run("at_arrival", 2, result(good=4800), SERVER),
            Run("at_arrival", 1, result(good=4200), SERVER),
            Run("oldest", 1, result(), SERVER)]
    assert summary(runs).splitlines()[2:] == [
        "| at_arrival | shared | 70.0, 80.0 | 75.0 |",
        "| oldest | shared | 70.0 | 70.0 |",
    ]


def scrape(queue: int, front: int, batches: int, rows: int, slope: float = 0.0005) -> Scrape:
    lines = [
        f'batchserve_requests_total{{runner="{MODEL}",code="200"}} {rows}',
        f'batchserve_requests_total{{runner="{MODEL}",code="503"}} {queue + front}',
        f'batchserve_latency_model_slope_seconds{{runner="{MODEL}",pid="7"}} {slope}',
        f'batchserve_dispatcher_batch_cap{{runner="{MODEL}",pid="7"}} 1',
        f'batchserve_unavailable_total{{runner="{MODEL}",reason="queue"}} {queue}',
        f'batchserve_unavailable_total{{runner="{MODEL}",reason="front"}} {front}',
        f'batchserve_unavailable_total{{runner="other",reason="queue"}} {queue * 7}',
        f'batchserve_rejections_total{{runner="{MODEL}",reason="queue"}} {queue}',
        f'batchserve_adaptive_batch_size_count{{runner="{MODEL}"}} {batches}',
        f'batchserve_adaptive_batch_size_sum{{runner="{MODEL}"}} {rows}',
    ]
    return Scrape.parse("\n".join(lines) + "\n")


def test_the_server_window_is_what_grew_between_two_readings() -> None:
    server = server_window(scrape(10, 5, 100, 120), scrape(410, 5, 1100, 1620, 0.0006))
    assert server == Server(codes={"200": 1500.0, "503": 400.0}, unavailable={"queue": 400.0},
                            rejections={"queue": 400.0}, batches=1000, rows=1500,
                            model={"slope_s": 0.0006, "cap": 1.0})  # the gauges at the end
    assert server.mean_batch == 1.5
    assert Server({}, {}, {}, 0, 0, {}).mean_batch is None


def durations(under_50ms: int, total: int) -> Scrape:
    name, labels = "batchserve_request_duration_seconds_bucket", f'runner="{MODEL}",code="200"'
    lines = [f'{name}{{{labels},le="0.02"}} {under_50ms // 2}',
             f'{name}{{{labels},le="0.05"}} {under_50ms}',
             f'{name}{{{labels},le="+Inf"}} {total}',
             f'{name}{{runner="other",code="200",le="+Inf"}} {total * 9}']
    return Scrape.parse("\n".join(lines) + "\n")


def test_late_at_the_server_is_what_grew_past_the_limit_bucket() -> None:
    before, after = durations(900, 910), durations(1890, 1930)
    assert late_at_server(before, after, MODEL, 0.05) == 30
    assert late_at_server(before, after, MODEL, 0.012) is None  # no bucket ends at 12 ms
    assert server_window(before, after, MODEL, 0.05).late == 30


def test_other_statuses_than_200_and_503_join_the_reasons() -> None:
    server = replace(SERVER, codes={"200": 10.0, "503": 1480.0, "413": 3594.0})
    assert server.non_ok() == "status 413 3,594, queue 1,400, front 80"


def test_what_one_row_costs_the_idle_model_is_read_from_the_gauges() -> None:
    assert SERVER.one_row_ms == pytest.approx(5.7)
    stretched = replace(SERVER, model={**SERVER.model, "stretch": 2.0})
    assert stretched.one_row_ms == pytest.approx(2.85)  # the curve, without the contention
    eased = replace(SERVER, model={**SERVER.model, "stretch": 0.5})
    assert eased.one_row_ms == pytest.approx(5.7)  # never more than a batch takes now
    assert replace(SERVER, model={}).one_row_ms is None


def test_the_shared_client_is_told_the_limit(tmp_path: Path) -> None:
    script = tmp_path / "loadgen.py"
    script.write_text("")
    command = SharedClient(script, slo_ms=12.0)._command("http://127.0.0.1:1/x", 300.0, 20.0, 1)
    assert command[command.index("--slo-ms") + 1] == "12"
