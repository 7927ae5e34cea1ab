"""The example models' side-by-side verdicts: the best setting, the knee, the merge of runs
measured apart, the verdict and the tables, from made-up runs."""

from __future__ import annotations

from benchmarks.peers.examples_table import (
    Run,
    Setting,
    best_setting,
    goodput_table,
    knee,
    merge,
    summary_table,
    verdict,
    verdict_line,
)


def run(server: str, rate: float, good: int, *, phase: str = "grid", size: int = 0,
        wait: int = 0, p99: float | None = 50.0, refused: int = 0, sent: int = 100,
        cpu: float = 30.0) -> Run:
    """``sent`` requests over 10 s, ``good`` of them OK within the limit."""
    return Run("resnet", phase, server, size, wait, rate, 10.0, sent, good, good + 1, refused,
               good / 10, 20.0, p99, cpu, "2026-11-27 12:00 UTC")


def test_the_best_setting_has_the_most_good_answers_over_the_sweep() -> None:
    sweep = [run("mosec", 20, 100, phase="sweep", size=4, wait=10),
             run("mosec", 40, 60, phase="sweep", size=4, wait=10),
             run("mosec", 20, 95, phase="sweep", size=16, wait=50),
             run("mosec", 40, 80, phase="sweep", size=16, wait=50)]
    assert best_setting(sweep) == Setting("mosec", 16, 50)


def test_a_tie_goes_to_the_lower_p99_then_the_smaller_batch() -> None:
    sweep = [run("triton", 40, 90, phase="sweep", size=4, wait=10, p99=250.0),
             run("triton", 40, 90, phase="sweep", size=16, wait=10, p99=120.0),
             run("triton", 40, 90, phase="sweep", size=8, wait=50, p99=120.0)]
    assert best_setting(sweep) == Setting("triton", 8, 50)


def test_the_knee_is_the_top_of_the_rates_that_all_held() -> None:
    grid = [run("mosec", 5, 100), run("mosec", 15, 99), run("mosec", 25, 98),
            run("mosec", 35, 100)]  # 35 held, but 25 did not: the knee stays at 15
    assert knee(grid) == 15
    assert knee([run("mosec", 5, 98)]) is None
    assert knee([]) is None


def test_a_new_run_replaces_the_old_one_and_a_new_setting_drops_the_old_grid() -> None:
    old = [run("mosec", 5, 90, size=4, wait=10), run("mosec", 15, 90, size=4, wait=10),
           run("mosec", 5, 90, phase="sweep", size=4, wait=10),
           run("batchserve", 5, 90)]
    new = [run("mosec", 5, 100, size=16, wait=50), run("batchserve", 5, 100)]
    merged = merge(old, new)
    grid = [(r.server, r.rate, r.good, r.max_batch_size) for r in merged if r.phase == "grid"]
    assert grid == [("batchserve", 5, 100, 0), ("mosec", 5, 100, 16)]
    assert sum(r.phase == "sweep" for r in merged) == 1  # a sweep run stays


def test_the_verdict_names_each_rate_and_knee_where_batchserve_is_short() -> None:
    runs = [run("batchserve", 5, 100), run("batchserve", 15, 97),
            run("mosec", 5, 100, size=4), run("mosec", 15, 99, size=4)]
    result = verdict(runs, "resnet", ["mosec"])
    assert not result.holds
    assert result.goodput_short == ("mosec at 15 req/s (9.7 < 9.9)",)
    assert result.knee_short == ("mosec (15 > 5)",)
    assert verdict_line(result) == (
        "- batchserve's goodput at least each peer's (rates 5, 15 req/s): no: mosec at 15 "
        "req/s (9.7 < 9.9).\n- batchserve's knee at least each peer's: no: mosec (15 > 5).")
    assert verdict([run("batchserve", 5, 100), run("mosec", 5, 100)], "resnet",
                   ["mosec"]).holds


def test_the_summary_states_the_setting_and_the_overload() -> None:
    runs = [run("mosec", 5, 100, size=16, wait=50, cpu=40.0),
            run("mosec", 15, 100, size=16, wait=50, cpu=31.25),
            run("mosec", 30, 150, phase="overload", size=16, wait=50, sent=300, refused=30,
                p99=900.0)]
    table = summary_table(runs, "resnet", 300.0, ["batchserve", "mosec"])
    assert table.splitlines()[2] == (
        "| mosec | max_batch_size=16, max_wait_ms=50 | 15 | 20.0 | 40.0 | 31.2 | 30 | 15.0 "
        "| 10.0 | 50.3 | 900.0 |")
    assert goodput_table(runs, "resnet", ["mosec"]).splitlines()[2] == (
        "| mosec | 10.0 (100%) | 10.0 (100%) |")
