"""A generated grid of cost profiles, caps, limits and loads, on which both refusal modes of the
adaptive policy are judged against BentoML's rule (`benchmarks.targets`).

Every cell is one Poisson scenario with single-row requests and a synthetic cost with lognormal
noise (sigma 0.05), run by BentoML's rule and by the adaptive policy refusing at arrival and
refusing the oldest, on the same arrivals (seed 1):

- intercept/slope ratios 0.5, 2, 10 and 50 rows: from cost almost proportional to rows to
  cost almost fixed per batch;
- caps (`max_batch_size`) 8, 32, 64 and 256, limits 10, 25, 100 and 500 ms;
- the cost is scaled so a full batch takes `FULL_SHARE` (a quarter) of the limit on average:
  `slope = FULL_SHARE * limit / (ratio + cap)`, `intercept = ratio * slope`; the limit is
  then 4 batch times at the cap, so the goodput of both modes is held to BentoML's;
- capacity in closed form: full batches back to back, `cap / (FULL_SHARE * limit)` req/s;
  each cost profile runs at four loads: steady at 80%, 150% and 200% of it, and "shift",
  which steps between 50% and 150% every `SHIFT_S` seconds (starting low, so its mean is
  the capacity);
- each run lasts long enough for `REQUESTS` arrivals and for `BATCHES` full batches, at least
  `MIN_SECONDS` and at most `MAX_SECONDS` simulated seconds (a shifting run, whole low-high
  cycles): goodput over a few dozen batches is mostly the luck of their noise draws (a run
  of 62 batches at cap 256 and 500 ms gave the two policies ratios of 0.986 to 1.016 across
  20 seeds). The floor binds only where 500 full batches take under 2 s, the limits of 10
  and 25 ms, whose cells see up to 200,000 arrivals a second and cost the most to simulate.

`python -m benchmarks.grid` prints one line per cell and the worst cell per target of each
mode; `benchmarks.dispatcher_table` prints the same. Everything is on the virtual clock and
seeded, so the grid is the same on any machine.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from batchserve.runner.sim.scenario import Cost, Phase, Scenario
from batchserve.runner.sim.simulate import Result, simulate
from benchmarks.at_arrival_bound import RESERVES, known_line
from benchmarks.targets import (
    MODES,
    TARGETS,
    TITLES,
    Mode,
    Verdict,
    needs_frontier,
    verdicts,
)

RATIOS = (0.5, 2.0, 10.0, 50.0)
CAPS = (8, 32, 64, 256)
LIMITS_MS = (10.0, 25.0, 100.0, 500.0)
FULL_SHARE = 0.25
NOISE = 0.05
SEED = 1
REQUESTS = 20_000
BATCHES = 500
MIN_SECONDS = 2.0
MAX_SECONDS = 60.0
SHIFT_S = 2.0
WORKERS = 2


@dataclass(frozen=True, slots=True)
class Load:
    """A cell's traffic in shares of its capacity: steady at one level, or stepping through
    the levels in turn, `SHIFT_S` seconds each."""

    name: str
    levels: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(self.levels) / len(self.levels)

    @property
    def cycle_s(self) -> float:
        """The length of one pass through the levels; 0 for a steady load."""
        return SHIFT_S * len(self.levels) if len(self.levels) > 1 else 0.0


LOADS = (Load("80%", (0.8,)), Load("150%", (1.5,)), Load("200%", (2.0,)),
         Load("shift", (0.5, 1.5)))


@dataclass(frozen=True, slots=True)
class Cell:
    ratio: float
    cap: int
    limit_ms: float
    load: Load

    @property
    def name(self) -> str:
        return f"r{self.ratio:g}/cap{self.cap}/{self.limit_ms:g}ms/{self.load.name}"

    @property
    def slope_ms(self) -> float:
        return FULL_SHARE * self.limit_ms / (self.ratio + self.cap)

    @property
    def intercept_ms(self) -> float:
        return self.ratio * self.slope_ms

    @property
    def capacity_rps(self) -> float:
        return self.cap / (FULL_SHARE * self.limit_ms / 1000.0)

    @property
    def rate(self) -> float:
        """The mean arrival rate."""
        return self.load.mean * self.capacity_rps

    @property
    def seconds(self) -> float:
        batches_s = BATCHES * FULL_SHARE * self.limit_ms / 1000.0
        seconds = min(MAX_SECONDS, max(MIN_SECONDS, REQUESTS / self.rate, batches_s))
        cycle = self.load.cycle_s
        return cycle * math.ceil(seconds / cycle) if cycle else seconds

    def phases(self) -> tuple[Phase, ...]:
        cost = Cost(self.intercept_ms, self.slope_ms, NOISE)
        levels = self.load.levels
        if len(levels) == 1:
            return (Phase(self.seconds, levels[0] * self.capacity_rps, cost),)
        count = round(self.seconds / SHIFT_S)
        return tuple(Phase(SHIFT_S, levels[i % len(levels)] * self.capacity_rps, cost)
                     for i in range(count))

    def scenario(self, seed: int = SEED) -> Scenario:
        return Scenario(self.name, self.limit_ms, self.cap, seed, 1, 1, self.phases())


@dataclass(frozen=True, slots=True)
class CellRun:
    """A cell's runs on the same arrivals: BentoML's rule, each refusal mode, and the
    known-line frontier where the at-arrival goodput target needs it."""

    cell: Cell
    bentoml: Result
    at_arrival: Result
    oldest: Result
    frontier: tuple[Result, ...] = ()

    def ours(self, mode: Mode) -> Result:
        return self.at_arrival if mode == "at_arrival" else self.oldest

    def verdicts(self, mode: Mode) -> list[Verdict]:
        return verdicts(mode, self.ours(mode), self.bentoml, self.cell.scenario(),
                        self.frontier)

    def to_json(self) -> dict[str, Any]:
        return {"cell": self.cell.name, "rate": self.cell.rate,
                "bentoml": self.bentoml.to_json(),
                **{mode: self.ours(mode).to_json() for mode in MODES},
                "frontier": [run.to_json() for run in self.frontier],
                "verdicts": {mode: [v.to_json() for v in self.verdicts(mode)] for mode in MODES}}


def cells() -> list[Cell]:
    """Every cell, in a fixed order: ratio, cap, limit, then load."""
    return [Cell(*values) for values in itertools.product(RATIOS, CAPS, LIMITS_MS, LOADS)]


def run_cell(cell: Cell) -> CellRun:
    scenario = cell.scenario()
    frontier = tuple(known_line(scenario, r) for r in RESERVES) if needs_frontier(scenario) else ()
    return CellRun(cell, simulate(scenario, "bentoml"), simulate(scenario, "adaptive"),
                   simulate(scenario, "adaptive", refuse="oldest"), frontier)


def run_grid(chosen: list[Cell], workers: int = WORKERS) -> list[CellRun]:
    """Run the cells on `workers` processes; the order of the answer is that of `chosen`."""
    # Costliest (most arrivals) first, so a long cell does not start last.
    order = sorted(range(len(chosen)), key=lambda i: -chosen[i].rate * chosen[i].seconds)
    with ProcessPoolExecutor(workers) as pool:
        done = dict(zip(order, pool.map(run_cell, [chosen[i] for i in order]), strict=True))
    return [done[i] for i in range(len(chosen))]


def table(runs: list[CellRun]) -> str:
    """One row per cell: the numbers behind each target, and which targets each mode misses."""
    lines = [
        "| cell | rate req/s | goodput bentoml | goodput adaptive | goodput oldest "
        "| late % bentoml | late % adaptive | late % oldest | refusal wait p99 ms bentoml "
        "| refusal wait p99 ms adaptive | refusal wait p99 ms oldest "
        "| false refusals % adaptive | misses adaptive | misses oldest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for run in runs:
        trio = (run.bentoml, run.at_arrival, run.oldest)
        share = 100.0 / run.bentoml.requests if run.bentoml.requests else 0.0
        misses = [", ".join(v.target for v in run.verdicts(mode) if not v.ok) or "-"
                  for mode in MODES]
        lines.append(
            f"| {run.cell.name} | {run.cell.rate:.0f} | "
            + " | ".join(f"{r.goodput_rps:.1f}" for r in trio) + " | "
            + " | ".join(f"{r.late * share:.3f}" for r in trio) + " | "
            + " | ".join(f"{r.reject_wait_p99_ms:.2f}" for r in trio)
            + f" | {run.at_arrival.false_rejections * share:.3f} | {' | '.join(misses)} |"
        )
    return "\n".join(lines)


def summary(runs: list[CellRun]) -> list[str]:
    """Per mode and target: how many cells pass, and the worst cell with its numbers."""
    out = []
    for mode in MODES:
        found = [run.verdicts(mode) for run in runs]
        out.append(f"{TITLES[mode]}:")
        for index, target in enumerate(TARGETS[mode]):
            column = [verdicts[index] for verdicts in found]
            judged = sum(v.judged for v in column)
            passed = sum(v.ok and v.judged for v in column)
            worst = max(range(len(runs)), key=lambda i: column[i].excess)
            unjudged = f" ({len(runs) - judged} not judged)" if judged < len(runs) else ""
            out.append(f"- {target}: {passed}/{judged} cells pass{unjudged}; worst "
                       f"{runs[worst].cell.name} ({column[worst].mark}): {column[worst].text}")
        every = sum(all(v.ok for v in verdicts) for verdicts in found)
        out.append(f"- every target: {every}/{len(runs)} cells")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grid")
    parser.add_argument("--workers", type=int, default=WORKERS)
    args = parser.parse_args(argv)
    runs = run_grid(cells(), args.workers)
    print(table(runs))
    print()
    print("\n".join(summary(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
