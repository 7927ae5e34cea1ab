"""The example models' sweep without a server: the requests each server gets, the rates each
phase runs at, and the page's block rendered from a results file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson

from benchmarks.peers.examples_sweep import (
    BLOCK,
    PLANS,
    answer,
    main,
    phase_rates,
    phase_settings,
    request,
    save_runs,
)
from benchmarks.peers.examples_table import Run, Setting


def grid_run(server: str, rate: float, good: int, size: int = 0, wait: int = 0,
             phase: str = "grid") -> Run:
    return Run("resnet", phase, server, size, wait, rate, 10.0, 100, good, good, 0, good / 10,
               20.0, 50.0, 30.0, "2026-11-27 12:00 UTC")


def test_the_image_is_binary_for_every_server_and_the_same_bytes() -> None:
    v2, headers = request("batchserve", "resnet")
    raw, _ = request("mosec", "resnet")
    assert request("triton", "resnet")[0] == v2
    header = int(headers["Inference-Header-Content-Length"])
    assert orjson.loads(v2[:header])["inputs"][0]["parameters"] == {"binary_data_size": 602112}
    assert v2[header:] == raw and len(raw) == 602112


def test_each_servers_answer_is_read_the_same() -> None:
    scores = np.arange(4, dtype=np.float32)
    v2 = orjson.dumps({"outputs": [{"name": "scores", "data": scores.tolist()}]})
    assert answer("mosec", "resnet", scores.tobytes()).tolist() == scores.tolist()
    assert answer("triton", "resnet", v2).tolist() == scores.tolist()
    assert answer("mosec", "encoder", orjson.dumps({"embedding": [1.5]})).tolist() == [1.5]


def test_a_peer_is_measured_at_its_best_setting_and_overloaded_at_twice_its_knee() -> None:
    runs = [grid_run("mosec", 20, 100, 16, 50, "sweep"), grid_run("mosec", 20, 90, 4, 10,
                                                                     "sweep"),
            grid_run("mosec", 3, 100, 16, 50), grid_run("mosec", 6, 99, 16, 50),
            grid_run("mosec", 10, 80, 16, 50)]
    assert list(phase_settings("grid", "resnet", ["batchserve", "mosec"], runs)) == [
        Setting("batchserve"), Setting("mosec", 16, 50)]
    assert phase_rates("overload", "resnet", Setting("mosec", 16, 50), runs) == [12.0]
    assert phase_rates("grid", "resnet", Setting("batchserve"), runs) == list(
        PLANS["resnet"].rates)


def test_the_page_block_is_rendered_from_the_results_alone(tmp_path: Path) -> None:
    results, page = tmp_path / "examples.json", tmp_path / "page.md"
    save_runs(results, [grid_run("batchserve", 3, 100), grid_run("mosec", 3, 100, 4, 10),
                        grid_run("mosec", 3, 100, 4, 10, "sweep")])
    page.write_text(f"before\n{BLOCK[0]}\nold\n{BLOCK[1]}\nafter\n")
    main(["--phases", "", "--results", str(results), "--doc", str(page)])
    text = page.read_text()
    assert "old" not in text and text.startswith("before\n") and text.endswith("after\n")
    assert "| mosec | max_batch_size=4, max_wait_ms=10 | 3 |" in text
    assert "knee at least each peer's: yes" in text
