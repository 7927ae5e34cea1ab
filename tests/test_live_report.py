"""How the live table judges and prints a run (benchmarks/live_clients.py, live_report.py)."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.live_clients import RunResult, from_shared
from benchmarks.live_report import Row, Window, markdown, summary

SHARED_LINE = {
    "sent": 1000, "ok": 990, "n_503": 8, "p50_ms": 4.0, "p99_ms": 20.0, "p99_503_ms": 2.5,
    "send_lag_p99_ms": 1.5, "good_frac": 0.985, "client_cpu_frac": 0.25, "wall_s": 12.0,
}


def result(**changes: object) -> RunResult:
    return replace(from_shared(SHARED_LINE, 100.0, 10.0), **changes)  # type: ignore[arg-type]


def window(ratio_p99: float | None) -> Window:
    return Window(ratio_p99, 10, 1.5, 0.8, {"200": 990.0}, {})


def test_the_shared_loadgen_line_maps_to_a_run() -> None:
    run = result()
    assert (run.sent, run.ok, run.refused, run.other) == (1000, 990, 8, 2)
    assert (run.p50_ms, run.p99_ms, run.refused_p99_ms) == (4.0, 20.0, 2.5)
    assert run.good == 985 and run.goodput == 98.5
    assert run.client_cpu_s == 3.0


def test_the_fastload_line_maps_to_a_run_of_its_name() -> None:
    """fastload.py gives the rate of answers within the limit where loadgen.py gives a share."""
    line = {k: v for k, v in SHARED_LINE.items() if k != "good_frac"} | {"goodput": 98.5}
    run = from_shared(line, 100.0, 10.0, client="fastload")
    assert run.client == "fastload" and run.good == 985 and run.ok == 990


def test_a_run_passes_with_at_most_one_percent_non_ok_and_p99_within_100_ms() -> None:
    assert result().passed  # exactly 1% non-OK
    assert not result(ok=989).passed
    assert result(p99_ms=100.0).passed
    assert not result(p99_ms=100.1).passed
    assert not result(p99_ms=None).passed  # no OK answer at all


def test_the_model_holds_within_a_factor_of_one_and_a_half() -> None:
    assert window(1.5).model_holds and window(0.67).model_holds
    assert not window(1.51).model_holds and not window(0.66).model_holds
    assert window(None).model_holds is None


def test_a_row_prints_every_column_and_the_summary_counts_per_client() -> None:
    rows = [Row(1, result(), window(1.1)), Row(2, result(p99_ms=150.0), window(2.0))]
    assert markdown(rows[:1], head=False) == (
        "| shared | 100 | 1 | 1000 | 990 | 0.80 | 0.20 | 4.0 | 20.0 | yes | 1.10 | yes | 1.5 "
        "| 0.80 | 1.50 |"
    )
    assert summary({"shared": rows}) == (
        "100 req/s: shared 1/2 passed; ratio p99 within [0.67, 1.5] in 1/2 windows"
    )
