"""The pipeline comparison's own parts, on made-up windows: rows run for nothing, mosec's best
setting, the verdicts and the table; and the chained client's reading of answers."""

from __future__ import annotations

import argparse
from typing import Any

import orjson
import pytest

from batchserve.api.bench.load_result import summarize
from benchmarks.pipeline_peers import report, servers, table
from benchmarks.pipeline_peers.chain_client import BodyParser


def window(server: str, rate: float, good: int, late: int = 0, refused: int = 0, *,
           step1_rows: float | None = None, wasted: float | None = None,
           **extra: Any) -> dict[str, Any]:
    """A made-up window: `good` answers at 5 ms, `late` at 150 ms, `refused` 503s at 1 ms."""
    latencies = [0.005] * good + [0.150] * late + [0.001] * refused
    statuses = [200] * (good + late) + [503] * refused
    load = summarize(rate, 10.0, latencies, statuses, [0.0] * len(statuses), 10.0, (1, 0), 0.0)
    return {"server": server, "rate": rate, "load": load.as_dict(), "cpu_s": 2.0,
            "step1_rows": step1_rows, "step1_batches": 10, "wasted_counter": wasted,
            "job": extra.pop("job", server), **extra}


def test_rows_run_for_nothing_are_the_first_steps_rows_less_the_good_answers() -> None:
    assert table.wasted_rows(1000.0, 990) == 10
    assert table.wasted_rows(990.0, 990) == 0
    assert table.wasted_rows(980.0, 990) == 0  # never below nothing


def test_mosec_s_best_setting_has_the_most_goodput_over_the_sweep_rates() -> None:
    sweep = [window("mosec", 1200, 1000, max_batch_size=8, max_wait_ms=2),
             window("mosec", 2000, 500, max_batch_size=8, max_wait_ms=2),
             window("mosec", 1200, 900, max_batch_size=32, max_wait_ms=10),
             window("mosec", 2000, 700, max_batch_size=32, max_wait_ms=10)]
    assert table.best_setting(sweep) == (32, 10)
    assert table.best_setting([]) is None


def test_goodput_and_low_load_verdicts() -> None:
    records = [window("pipeline", 50, 500), window("mosec", 50, 500),
               window("pipeline", 2000, 9000, refused=1000), window("mosec", 2000, 9500),
               window("tokenize", 50, 500), window("text", 50, 500)]
    verdicts = table.goodput_verdicts(records)
    assert [(rate, held) for rate, _, _, held in verdicts] == [(50, True), (2000, False)]
    assert table.low_load_p50(records, 50) == (5.0, 5.0, 5.0)
    assert table.low_load_p50(records, 2000) is None


def test_a_row_says_rows_run_for_nothing_with_the_server_s_own_count() -> None:
    record = window("pipeline", 2000, 900, late=50, refused=50, step1_rows=1000, wasted=95)
    text = table.main_table([record, window("mosec", 50, 500, step1_rows=500)], 100)
    lines = text.splitlines()
    assert lines[0].startswith("| rate req/s | server | sent | goodput ≤ 100 ms req/s |")
    assert lines[2] == ("| 50 | mosec, two-stage pipeline | 500 | 50 | 5.0 | 5.0 | 4.00 | 0.0 "
                        "| 0.0 | 500 / 10 | 0 |")
    assert lines[3] == ("| 2,000 | batchserve, pipeline `classify` | 1,000 | 90 | 5.0 | 150.0 "
                        "| 2.00 | 5.0 | 0.0 | 1,000 / 10 | 100 (95) |")


def test_the_sweep_table_has_a_column_a_rate_and_a_row_a_setting() -> None:
    sweep = [window("mosec", 1200, 1000, max_batch_size=8, max_wait_ms=2),
             window("mosec", 2000, 500, max_batch_size=8, max_wait_ms=2)]
    assert table.sweep_table(sweep).splitlines() == [
        "| max_batch_size | max_wait_time ms | goodput at 1,200 req/s | goodput at 2,000 req/s |",
        "|---:|---:|---:|---:|",
        "| 8 | 2 | 100 | 50 |",
    ]


def test_the_chained_client_reads_bodies_split_anywhere() -> None:
    first = b'{"outputs":[{"name":"tokens","datatype":"INT64","shape":[3],"data":[1,2,3]}]}'
    wire = (b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(first), first)
            + b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}")
    parser = BodyParser()
    got = [answer for i in range(0, len(wire), 7) for answer in parser.feed(wire[i:i + 7])]
    assert got == [(200, first), (503, b"{}")]
    assert orjson.loads(servers.follow(first)) == {"inputs": [
        {"name": "tokens", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]}]}


@pytest.mark.parametrize("rows,good,expected", [(10.4, 10, 0), (10.6, 10, 1)])
def test_rows_are_whole(rows: float, good: int, expected: int) -> None:
    assert table.wasted_rows(rows, good) == expected


def test_the_section_says_each_target_with_its_numbers() -> None:
    args = argparse.Namespace(seconds=10.0, warmup_seconds=3.0, warmup_rate=200.0,
                              low_rate=50.0, knee=1000.0)
    records = [
        window("pipeline", 50, 500, step1_rows=500, wasted=0, job="low 50"),
        window("tokenize", 50, 500, job="low 50"), window("text", 50, 500, job="low 50"),
        window("mosec", 50, 500, step1_rows=500, job="mosec 50"),
        window("pipeline", 2000, 900, refused=100, step1_rows=1000, wasted=100,
               runner_refusals={"tokenize": 0.0, "text": 100.0}, job="pipeline 2000"),
        window("mosec", 2000, 1000, step1_rows=1000, job="mosec 2000"),
        window("mosec", 2000, 1000, max_batch_size=8, max_wait_ms=2, job="sweep 8 2"),
    ]
    state = {"records": records, "began": "2026-01-01 00:00 UTC", "minutes": 1.0}
    text = report.markdown(state, args, 100.0)
    assert "- At 50 req/s the pipeline's goodput is 50.0/s, mosec's 50.0/s: at least mosec's." \
        in text
    assert "- At 2,000 req/s the pipeline's goodput is 90.0/s, mosec's 100.0/s: 10.0/s below " \
        "mosec's." in text
    assert "+0.0 ms" not in text and "10.0 ms summed: -5.0 ms." in text
    assert ("- At 2,000 req/s the pipeline's tokenize ran 1,000 rows, 100 of them (10.0%) for "
            "requests not answered within the limit (the server's own count: 100); refused by "
            "the runners themselves: 0 by `tokenize`, 100 by `text`.") in text
    assert "max_batch_size=8, max_wait_time=2" in text
