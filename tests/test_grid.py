"""The generated grid of `benchmarks.grid`: its cells, their traffic, and the worst cell per
target of each mode."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from batchserve.runner.sim.simulate import Result, arrivals, simulate
from benchmarks.grid import (
    BATCHES,
    CAPS,
    FULL_SHARE,
    LIMITS_MS,
    LOADS,
    MAX_SECONDS,
    MIN_SECONDS,
    RATIOS,
    REQUESTS,
    SEED,
    SHIFT_S,
    Cell,
    CellRun,
    cells,
    run_cell,
    summary,
    table,
)
from benchmarks.targets import long_limit

BY_NAME = {load.name: load for load in LOADS}


def cell(name: str) -> Cell:
    return next(c for c in cells() if c.name == name)


def test_grid_has_every_combination_once_with_full_batches_a_share_of_the_limit() -> None:
    grid = cells()
    assert [load.name for load in LOADS] == ["80%", "150%", "200%", "shift"]
    assert len(grid) == len(RATIOS) * len(CAPS) * len(LIMITS_MS) * len(LOADS) == 256
    assert len({c.name for c in grid}) == len(grid)
    for c in grid:
        scenario = c.scenario()
        cost = scenario.phases[0].cost
        assert cost.intercept_ms == pytest.approx(c.ratio * cost.per_item_ms)
        assert cost.mean_s(c.cap) == pytest.approx(FULL_SHARE * c.limit_ms / 1000.0)
        assert c.rate == pytest.approx(c.load.mean * c.cap / cost.mean_s(c.cap))
        assert scenario.seconds == pytest.approx(c.seconds)
        assert long_limit(scenario)  # exactly 4 batch times: goodput is held to BentoML's


def test_a_steady_cell_is_one_phase_long_enough_for_its_arrivals_and_batches() -> None:
    for c in cells():
        if c.load.cycle_s:
            continue
        (phase,) = c.phases()
        assert phase.rate == pytest.approx(c.load.levels[0] * c.capacity_rps)
        full_s = FULL_SHARE * c.limit_ms / 1000.0
        assert c.seconds == MAX_SECONDS or (
            c.seconds >= MIN_SECONDS and c.seconds * c.rate >= REQUESTS - 1e-6
            and c.seconds >= BATCHES * full_s - 1e-9)


def test_a_shifting_cell_steps_between_half_and_one_and_a_half_capacity() -> None:
    shift = BY_NAME["shift"]
    for c in (c for c in cells() if c.load == shift):
        phases = c.phases()
        assert len(phases) % 2 == 0  # whole low-high cycles: the mean rate is the capacity
        assert {phase.seconds for phase in phases} == {SHIFT_S}
        assert [phase.rate / c.capacity_rps for phase in phases] == \
            pytest.approx([0.5, 1.5] * (len(phases) // 2))
        assert MIN_SECONDS <= c.seconds <= MAX_SECONDS
    quick = cell("r2/cap256/10ms/shift")  # 100,000 req/s: one cycle is plenty of arrivals
    assert quick.seconds == 2 * SHIFT_S
    times = [t for t, _ in arrivals(quick.scenario(), 1)]
    low = sum(t < SHIFT_S for t in times)
    assert 2.7 < (len(times) - low) / low < 3.3  # the high phase brings three times as many


def steady(result: Result) -> Result:
    """A result without what the host's clock measured (how long the run and its refits took)."""
    return replace(result, wall_s=0.0, refit_ms_mean=0.0, refit_ms_max=0.0)


def test_grid_cells_are_deterministic() -> None:
    """A cell's runs follow from the cell and the grid's seed alone: run again, they give the
    same numbers, and these are the runs at `SEED`, which another seed would change."""
    names = [c.name for c in cells()]
    assert names[:3] == ["r0.5/cap8/10ms/80%", "r0.5/cap8/10ms/150%", "r0.5/cap8/10ms/200%"]
    assert names[-1] == "r50/cap256/500ms/shift"  # ratio, cap, limit, then load
    chosen = cell("r2/cap8/500ms/shift")
    assert chosen.scenario().seed == SEED
    first, second = run_cell(chosen), run_cell(chosen)
    for run in (first, second):
        assert run.bentoml.requests == run.at_arrival.requests == run.oldest.requests > 0
        assert (run.at_arrival.policy, run.oldest.policy) == ("adaptive", "adaptive (oldest)")
        assert run.frontier == ()

    def trio(run: CellRun) -> list[Result]:
        return [steady(r) for r in (run.bentoml, run.at_arrival, run.oldest)]

    assert trio(first) == trio(second)

    def at_seed(seed: int) -> list[Result]:
        scenario = chosen.scenario(seed)
        return [steady(r) for r in (simulate(scenario, "bentoml", seed=seed),
                                    simulate(scenario, "adaptive", seed=seed),
                                    simulate(scenario, "adaptive", seed=seed, refuse="oldest"))]

    assert trio(first) == at_seed(SEED)
    other = at_seed(SEED + 1)
    for ours, theirs in zip(trio(first), other, strict=True):
        assert ours.requests != theirs.requests, f"{ours.policy}: seed {SEED + 1} drew the same"
        assert ours != theirs

    saved = json.loads(json.dumps(first.to_json()))
    assert saved["cell"] == "r2/cap8/500ms/shift"
    assert [v["target"] for v in saved["verdicts"]["oldest"]] == \
        ["goodput", "late", "refusal wait"]


def made_up(goodput: float, late: int = 0, wait_ms: float = 0.0, policy: str = "bentoml",
            ) -> Result:
    return Result(scenario="c", policy=policy, seconds=10.0, requests=10_000, ok=9_000,
                  rejected=1_000, late=late, goodput_rps=goodput, p50_ms=1.0, p99_ms=2.0,
                  mean_batch_size=4.0, false_rejections=0, rejected_at_arrival=1_000,
                  reject_wait_p99_ms=wait_ms, batches=100)


def test_the_summary_names_the_worst_cell_per_target_of_each_mode() -> None:
    fine, worse, worst = (cell(f"r{ratio}/cap8/100ms/150%") for ratio in (0.5, 2, 10))
    runs = [
        CellRun(fine, made_up(100.0, wait_ms=30.0), made_up(100.0, policy="adaptive"),
                made_up(100.0, wait_ms=30.0, policy="adaptive (oldest)")),
        CellRun(worse, made_up(100.0, wait_ms=30.0), made_up(98.0, late=20, policy="adaptive"),
                made_up(98.5, wait_ms=31.0, policy="adaptive (oldest)")),
        CellRun(worst, made_up(100.0, wait_ms=30.0), made_up(97.0, policy="adaptive"),
                made_up(100.0, late=30, wait_ms=40.0, policy="adaptive (oldest)")),
    ]
    text = summary(runs)
    assert text[0] == "adaptive, refusing at arrival (the default):"
    assert text[1].startswith("- goodput: 1/3 cells pass; worst r10/cap8/100ms/150% (MISS): "
                              "goodput 97.0 vs bentoml 100.0")
    assert text[2].startswith("- late: 2/3 cells pass; worst r2/cap8/100ms/150% (MISS): "
                              "late 20/10000 = 0.200%")
    assert text[5] == "- every target: 1/3 cells"
    assert text[6] == "adaptive (oldest), refusing the oldest:"
    assert text[7].startswith("- goodput: 2/3 cells pass; worst r2/cap8/100ms/150% (MISS)")
    assert text[8].startswith("- late: 2/3 cells pass; worst r10/cap8/100ms/150% (MISS)")
    assert text[9].startswith("- refusal wait: 1/3 cells pass; worst r10/cap8/100ms/150% "
                              "(MISS): refusal wait p99 40.00 ms vs bound 30.00 ms")
    assert text[10] == "- every target: 1/3 cells"
    rows = table(runs).splitlines()
    assert len(rows) == 2 + len(runs)
    assert all(row.count("|") == rows[0].count("|") for row in rows)
    assert rows[3].endswith("| goodput, late | goodput, refusal wait |")
    assert rows[4].endswith("| goodput | late, refusal wait |")
