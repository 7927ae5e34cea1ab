"""`python -m benchmarks.dispatcher_table` end to end on two small scenarios: both modes in the
table and the targets, the frontier where a short limit needs it, the seed sweep of the
scenarios that miss, the README block and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.dispatcher_table import README_END, README_START, main

# A limit of 2.3 batch times on a plain line (the frontier judges goodput), and a limit of
# 5.4 batch times under stalls (BentoML's goodput does).
SHORT = """slo_ms: 12
max_batch_size: 8
seed: 1
cost: {intercept_ms: 3.6, per_item_ms: 0.2, noise: 0.05}
phases:
  - {seconds: 3, rate: 400}
"""
LONG = """slo_ms: 30
max_batch_size: 8
seed: 1
cost: {intercept_ms: 4, per_item_ms: 0.2, noise: 0.05, stalls: {probability: 0.01, ms: 40}}
phases:
  - {seconds: 3, rate: 600}
"""


def _reject_infinity(name: str) -> None:
    raise ValueError(f"the JSON holds {name}")


def test_one_command_judges_both_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    (folder / "load_80.yml").write_text(LONG)
    (folder / "tight_12ms.yml").write_text(SHORT)
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{README_START}\nold\n{README_END}\nafter\n")
    saved = tmp_path / "table.json"
    assert main(["--scenarios", str(folder), "--skip-capacity", "--skip-grid", "--seeds", "2",
                 "--workers", "1", "--json", str(saved), "--readme", str(readme)]) == 0
    out = capsys.readouterr().out
    for name in ("load_80", "tight_12ms"):
        for policy in ("adaptive", "adaptive (oldest)", "bentoml", "none"):
            assert f"| {name} | {policy} | " in out
    judged = out.split("the targets of each mode")[1]
    assert "adaptive, refusing at arrival (the default):" in judged
    assert "adaptive (oldest), refusing the oldest:" in judged
    assert ": tight_12ms: goodput " in judged and "vs known-line frontier" in judged
    assert ": load_80: goodput " in judged and "vs bentoml" in judged
    assert judged.count(": tight_12ms: ") == 4 + 3
    text = readme.read_text()
    assert text.startswith(f"before\n{README_START}\n| scenario | policy | goodput req/s |")
    assert text.endswith(f"{README_END}\nafter\n")
    assert "| tight_12ms | adaptive (oldest) | " in text and "old\n" not in text
    dump = json.loads(saved.read_text(), parse_constant=_reject_infinity)
    assert len(dump["tight_12ms"]["frontier"]) == 6 and dump["load_80"]["frontier"] == []
    assert [run["policy"] for run in dump["load_80"]["runs"]][:3] == \
        ["adaptive", "adaptive (oldest)", "bentoml"]


def test_the_seed_sweep_covers_only_the_modes_that_miss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    (folder / "tight_12ms.yml").write_text(SHORT)
    assert main(["--scenarios", str(folder), "--skip-capacity", "--skip-grid", "--seeds", "2",
                 "--workers", "1"]) == 0
    out = capsys.readouterr().out
    targets = out.split("the targets of each mode")[1].split("the targets on seeds 1-2")[0]
    sweep = out.split("the targets on seeds 1-2")[1].split("refits:")[0]
    for title, count in (("adaptive, refusing at arrival (the default):", 4),
                         ("adaptive (oldest), refusing the oldest:", 3)):
        block = targets.split(title)[1].split("\n\n")[0].split("adaptive (oldest)")[0]
        misses = "- MISS: tight_12ms" in block
        swept = sweep.split(title)[1].split("adaptive (oldest)")[0]
        assert ("- tight_12ms: goodput " in swept) == misses
        assert ("- no scenario misses on its first run" in swept) == (not misses)
        if misses:
            line = next(line for line in swept.splitlines() if line.startswith("- tight_12ms"))
            assert line.count("/2") + line.count(" n/a") == count


def test_the_sweeps_own_seed_gives_the_first_runs_verdicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    # tight_12ms's own traffic, for 5 s: a limit of a third of a full batch, missed at arrival.
    (folder / "tight_12ms.yml").write_text(
        "slo_ms: 12\ncost: {intercept_ms: 5, per_item_ms: 0.5, noise: 0.05}\n"
        "phases:\n  - {seconds: 5, rate: 300}\n")
    assert main(["--scenarios", str(folder), "--skip-capacity", "--skip-grid", "--seeds", "1",
                 "--workers", "1"]) == 0
    out = capsys.readouterr().out
    targets = out.split("the targets of each mode")[1].split("the targets on seeds 1-1")[0]
    sweep = out.split("the targets on seeds 1-1")[1].split("refits:")[0]
    verdicts = [line for line in targets.splitlines() if line.startswith("- ")]
    assert any(line.startswith("- MISS") for line in verdicts)
    for line in verdicts:
        if line.startswith("- MISS"):
            assert f"  - worst, seed 1: {line.split(': ', 2)[2]}" in sweep
