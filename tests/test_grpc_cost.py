"""`python -m benchmarks.grpc_cost`'s table, from made-up windows, and its place in the docs."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import grpc_cost
from benchmarks.grpc_cost import BARE, BATCHSERVE, TRITON, Session, Window
from benchmarks.live_table import replace_block
from tests.conftest import ROOT


def session(tmp_path: Path) -> Session:
    found = Session(argparse.Namespace(rates="1600,3200", seconds=10.0, warmup=3.0,
                                       out=tmp_path))
    costs = {BATCHSERVE[0]: 0.6, BATCHSERVE[1]: 0.5, BARE[0]: 0.4, BARE[1]: 0.1, TRITON: 1.0}
    for target, ms in costs.items():
        for rate in found.rates:
            sent = int(rate * 10)
            found.windows.append(Window(target, rate, sent, sent, 12.0, ms * sent / 1e3, 3))
    return found


def test_the_table_has_a_row_per_target_and_the_two_doors_beyond_their_floors(
    tmp_path: Path
) -> None:
    text = grpc_cost.markdown(session(tmp_path), "today")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 6  # the head and five targets
    assert f"| {BATCHSERVE[0]} | 0.600 | 0.600 | 100.0, 12.0 | 100.0, 12.0 | - | - |" in rows
    assert ("At 1,600 req/s the gRPC door adds 0.200 ms beyond its bare server; the HTTP door "
            "(JSON) 0.400 beyond uvicorn's.") in text


def test_a_window_passes_within_the_limit_and_with_few_failures() -> None:
    assert Window("t", 100, 1000, 990, 100.0, 1.0, 1).passed
    assert not Window("t", 100, 1000, 989, 10.0, 1.0, 1).passed
    assert not Window("t", 100, 1000, 1000, 100.5, 1.0, 1).passed


def test_the_table_goes_between_the_markers_of_the_benchmarks_page(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text((ROOT / "docs" / "benchmarks.md").read_text())
    replace_block(page, "THE TABLE", grpc_cost.START, grpc_cost.END)
    text = page.read_text()
    assert f"{grpc_cost.START}\nTHE TABLE\n{grpc_cost.END}" in text
    assert text.count(grpc_cost.START) == 1


def test_a_failing_window_says_how_much_the_server_refused() -> None:
    refused = Window("t", 100, 1000, 350, 20.0, 1.0, 1, 0.5, 650)
    assert grpc_cost._outcome(refused) == "35.0, 20.0 (fails; 65% refused)"
    assert grpc_cost._outcome(Window("t", 100, 1000, 900, 20.0, 1.0, 1)) == "90.0, 20.0 (fails)"
