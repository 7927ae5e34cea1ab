"""One command for the dispatcher results in docs/dispatcher-results.md.

    python -m benchmarks.dispatcher_table [--scenarios DIR] [--json FILE] [--skip-capacity]
                                          [--skip-grid] [--seeds N] [--workers N]
                                          [--readme FILE]

For every scenario it runs the adaptive policy in both refusal modes (at arrival, the default,
and the oldest), BentoML's rule, no batching, and the best fixed (window, cap) pair found by a
grid search in hindsight on that same traffic, and, where a short limit on a plain cost line
needs it, `KnownLinePolicy` at each of its reserves (`benchmarks.at_arrival_bound`). It then
finds the capacity (the highest Poisson rate the best fixed setting serves with p99 within the
SLO), checks the default mode at low load, at 80% load, in overload and under changing
traffic, judges each mode's targets (`benchmarks.targets`) on every scenario, and runs the
generated grid (`benchmarks.grid`) with the worst cell per target of each mode. `--seeds N`
judges again on seeds 1..N each mode on the scenarios where it misses a target.
`--readme FILE` puts the trade-off table of the two modes and BentoML's rule between the lines
`<!-- refusal-modes: start -->` and `<!-- refusal-modes: end -->` of FILE.
Everything runs on the virtual clock, so the output is the same on any machine for a given
seed, except the refit times measured on the wall clock.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from batchserve.runner.sim.scenario import Scenario, load_scenario
from batchserve.runner.sim.simulate import Result, best_fixed, simulate
from benchmarks import grid
from benchmarks.at_arrival_bound import RESERVES, known_line
from benchmarks.live_table import replace_block
from benchmarks.targets import (
    MODES,
    TARGETS,
    TITLES,
    Mode,
    Verdict,
    lines,
    needs_frontier,
    verdicts,
)

HERE = Path(__file__).parent
CAPACITY_BASE = "load_80"
CAPACITY_SECONDS = 30.0
CAPACITY_GRID = ((0.0, 1.0, 2.0, 5.0, 10.0), (64, 48, 32))
DYNAMIC = ("steps", "bursts", "cost_doubling")
TRADE_OFF = ("tight_12ms", "bursts", "load_80")
README_START = "<!-- refusal-modes: start -->"
README_END = "<!-- refusal-modes: end -->"
WORKERS = 2


@dataclass(frozen=True, slots=True)
class Runs:
    """One scenario's runs on the same arrivals."""

    at_arrival: Result
    oldest: Result
    bentoml: Result
    none: Result
    fixed: Result
    frontier: tuple[Result, ...] = ()

    @property
    def table(self) -> tuple[Result, ...]:
        """The runs of the scenario table, in its order."""
        return (self.at_arrival, self.oldest, self.bentoml, self.none, self.fixed)

    def ours(self, mode: Mode) -> Result:
        return self.at_arrival if mode == "at_arrival" else self.oldest

    def verdicts(self, mode: Mode, scenario: Scenario) -> list[Verdict]:
        return verdicts(mode, self.ours(mode), self.bentoml, scenario, self.frontier)


def run_scenario(scenario: Scenario) -> Runs:
    """Both modes, BentoML, no batching and the best fixed pair, on the same arrivals."""
    return Runs(simulate(scenario, "adaptive"), simulate(scenario, "adaptive", refuse="oldest"),
                simulate(scenario, "bentoml"), simulate(scenario, "none"),
                best_fixed(scenario)[2])


def fixed_meets_slo(scenario: Scenario, rate: float) -> bool:
    """Does any fixed (window, cap) pair serve Poisson `rate` with p99 within the SLO?"""
    steady = replace(
        scenario, phases=(replace(scenario.phases[0], rate=rate, seconds=CAPACITY_SECONDS),)
    )
    windows, caps = CAPACITY_GRID
    for cap in caps:
        for window_ms in windows:
            result = simulate(steady, "fixed", window_s=window_ms / 1000.0, cap=cap)
            if result.p99_ms <= scenario.slo_ms:
                return True
    return False


def capacity(scenario: Scenario, low: float = 1000.0, high: float = 2000.0) -> float:
    """Bisect to 5 req/s on the best fixed setting's p99: the capacity the overload check is
    held to."""
    while high - low > 5.0:
        middle = (low + high) / 2.0
        low, high = (middle, high) if fixed_meets_slo(scenario, middle) else (low, middle)
    return low


def _frontier(pool: Executor, scenario: Scenario, seed: int | None = None) -> list[Future[Result]]:
    """The known-line runs a short limit's goodput is held to, one job per reserve; none where
    the scenario does not need them."""
    if not needs_frontier(scenario):
        return []
    return [pool.submit(known_line, scenario, reserve, seed) for reserve in RESERVES]


def _arrivals(scenario: Scenario) -> float:
    """How many requests the scenario brings: what a run of it costs, roughly."""
    return sum(phase.rate * phase.seconds for phase in scenario.phases)


def run_scenarios(
    scenarios: dict[str, Scenario], workers: int, search_capacity: bool
) -> tuple[dict[str, Runs], float]:
    """Every scenario's runs, and the capacity (searched beside them, or assumed 1700 req/s)."""
    base = scenarios.get(CAPACITY_BASE)
    # Costliest first, so that no long job starts last.
    order = sorted(scenarios, key=lambda name: -_arrivals(scenarios[name]))
    with ProcessPoolExecutor(workers) as pool:
        found = pool.submit(capacity, base) if search_capacity and base is not None else None
        runs = {name: pool.submit(run_scenario, scenarios[name]) for name in order}
        frontiers = {name: _frontier(pool, scenarios[name]) for name in order}
        done = {name: replace(runs[name].result(),
                              frontier=tuple(job.result() for job in frontiers[name]))
                for name in scenarios}
        return done, 1700.0 if found is None else found.result()


def _seed(job: tuple[Scenario, int, tuple[Mode, ...]]) -> dict[Mode, list[Verdict]]:
    """The verdicts of `modes` on one seed of a scenario."""
    scenario, seed, modes = job
    bento = simulate(scenario, "bentoml", seed=seed)
    frontier = ([known_line(scenario, reserve, seed) for reserve in RESERVES]
                if "at_arrival" in modes and needs_frontier(scenario) else [])
    return {mode: verdicts(mode, simulate(scenario, "adaptive", seed=seed, refuse=mode), bento,
                           scenario, frontier) for mode in modes}


def missed(results: dict[str, Runs], scenarios: dict[str, Scenario]) -> dict[str, list[Mode]]:
    """Per scenario, the modes that miss one of their targets on it."""
    out = {name: [mode for mode in MODES
                  if not all(v.ok for v in runs.verdicts(mode, scenarios[name]))]
           for name, runs in results.items()}
    return {name: modes for name, modes in out.items() if modes}


def seed_sweep(
    scenarios: dict[str, Scenario], results: dict[str, Runs], seeds: int, workers: int
) -> list[str]:
    """Each mode's targets on seeds 1..`seeds` of the scenarios where it misses: on how many
    seeds each holds, and the worst seed of each target that misses on one. A scenario's own
    seed is judged on the runs already made."""
    chosen = missed(results, scenarios)
    jobs = [(scenarios[name], seed, tuple(modes)) for name, modes in chosen.items()
            for seed in range(1, seeds + 1) if seed != scenarios[name].seed]
    with ProcessPoolExecutor(workers) as pool:
        found = iter(pool.map(_seed, jobs))
    per_seed = {name: [{mode: results[name].verdicts(mode, scenarios[name]) for mode in modes}
                       if seed == scenarios[name].seed else next(found)
                       for seed in range(1, seeds + 1)]
                for name, modes in chosen.items()}
    out = []
    for mode in MODES:
        out.append(f"{TITLES[mode]}:")
        names = [name for name, modes in chosen.items() if mode in modes]
        for name in names:
            out += _seed_lines(name, mode, [verdicts[mode] for verdicts in per_seed[name]])
        if not names:
            out.append("- no scenario misses on its first run")
    return out


def _seed_lines(name: str, mode: Mode, per_seed: list[list[Verdict]]) -> list[str]:
    counts, worst = [], []
    for index, target in enumerate(TARGETS[mode]):
        column = [found[index] for found in per_seed]
        judged = [v for v in column if v.judged]
        counts.append(f"{target} {sum(v.ok for v in judged)}/{len(judged)}" if judged
                      else f"{target} n/a")
        seed = max(range(len(column)), key=lambda i: column[i].excess)
        if not column[seed].ok:
            worst.append(f"  - worst, seed {seed + 1}: {column[seed].text}")
    return [f"- {name}: {', '.join(counts)}", *worst]


def markdown(results: dict[str, Runs]) -> str:
    lines = [
        "| scenario | policy | goodput req/s | p50 ms | p99 ms | rejected % | late % "
        "| false rej. | mean batch | refusal wait p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        for run in runs.table:
            share = 100.0 / run.requests if run.requests else 0.0
            lines.append(
                f"| {name} | {run.policy} | {run.goodput_rps:.1f} | {run.p50_ms:.2f} "
                f"| {run.p99_ms:.1f} | {run.rejected * share:.2f} | {run.late * share:.3f} "
                f"| {run.false_rejections} | {run.mean_batch_size:.1f} "
                f"| {run.reject_wait_p99_ms:.1f} |"
            )
    return "\n".join(lines)


def trade_off(results: dict[str, Runs], names: Iterable[str] = TRADE_OFF) -> str:
    """Goodput, lateness and refusal wait of BentoML's rule and both modes on a few
    scenarios: what refusing the oldest buys and what it costs."""
    lines = ["| scenario | policy | goodput req/s | late % | refusal wait p99 ms |",
             "|---|---|---:|---:|---:|"]
    for name in names:
        if name not in results:
            continue
        runs = results[name]
        for run in (runs.bentoml, runs.at_arrival, runs.oldest):
            share = 100.0 / run.requests if run.requests else 0.0
            lines.append(f"| {name} | {run.policy} | {run.goodput_rps:.1f} "
                         f"| {run.late * share:.3f} | {run.reject_wait_p99_ms:.1f} |")
    return "\n".join(lines)


def one_request_ms(scenario: Scenario) -> float:
    """The median time of a batch of one request on the scenario's first cost: the lognormal
    noise on it has median 1, so this is the cost curve's own value."""
    return scenario.phases[0].cost.mean_s(scenario.size_min) * 1000.0


def checks(results: dict[str, Runs], cap_rps: float, scenarios: dict[str, Scenario]) -> list[str]:
    """The default mode's checks at low load, 80% load, overload and changing traffic, each
    with its numbers and PASS or MISS."""
    out: list[str] = []

    def say(ok: bool, text: str) -> None:
        out.append(f"- {'PASS' if ok else 'MISS'}: {text}")

    if "low_load" in results:
        low = results["low_load"].at_arrival
        single = one_request_ms(scenarios["low_load"])
        say(abs(low.p50_ms - single) <= 0.5,
            f"low load: p50 {low.p50_ms:.2f} ms vs one item {single:.2f} ms (within 0.5 ms)")
    if "load_80" in results:
        run = results["load_80"].at_arrival
        say(run.p99_ms <= scenarios["load_80"].slo_ms and run.rejected <= 0.005 * run.requests
            and run.late <= 0.001 * run.requests,
            f"80% load: p99 {run.p99_ms:.1f} ms, rejected {run.rejected}/{run.requests}, "
            f"late {run.late}")
    if "overload_150" in results:
        run = results["overload_150"].at_arrival
        say(run.goodput_rps >= 0.95 * cap_rps and run.late <= 0.001 * run.requests
            and run.rejected_at_arrival == run.rejected,
            f"overload: goodput {run.goodput_rps:.1f} vs 95% of capacity "
            f"{0.95 * cap_rps:.1f}, late {run.late}/{run.requests}, refused at arrival "
            f"{run.rejected_at_arrival}/{run.rejected}")
    for name in DYNAMIC:
        if name in results:
            ours, fixed = results[name].at_arrival, results[name].fixed
            say(ours.goodput_rps >= fixed.goodput_rps,
                f"{name}: goodput {ours.goodput_rps:.1f} vs best fixed {fixed.policy} "
                f"{fixed.goodput_rps:.1f}")
    return out


def target_lines(results: dict[str, Runs], scenarios: dict[str, Scenario]) -> list[str]:
    """Each mode's targets on every scenario, with their numbers."""
    out = []
    for mode in MODES:
        out.append(f"{TITLES[mode]}:")
        for name, runs in results.items():
            out += lines(name, runs.verdicts(mode, scenarios[name]))
    return out


def _json(results: dict[str, Runs], scenarios: dict[str, Scenario]) -> dict[str, Any]:
    return {name: {"runs": [run.to_json() for run in runs.table],
                   "frontier": [run.to_json() for run in runs.frontier],
                   "verdicts": {mode: [v.to_json() for v in runs.verdicts(mode, scenarios[name])]
                                for mode in MODES}}
            for name, runs in results.items()}


def _refits(results: dict[str, Runs]) -> str:
    refits = [run for runs in results.values() for run in runs.table if run.refits]
    count = sum(run.refits for run in refits)
    mean = sum(run.refit_ms_mean * run.refits for run in refits) / count if count else 0.0
    return (f"refits: {count}, mean {mean:.2f} ms, max "
            f"{max((r.refit_ms_max for r in refits), default=0.0):.2f} ms "
            "(wall clock, this machine)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatcher_table")
    parser.add_argument("--scenarios", type=Path, default=HERE / "scenarios")
    parser.add_argument("--json", type=Path, help="also write every result to this file")
    parser.add_argument("--skip-capacity", action="store_true",
                        help="assume 1700 req/s instead of searching for it (saves a minute)")
    parser.add_argument("--skip-grid", action="store_true", help="do not run the grid")
    parser.add_argument("--seeds", type=int, default=0,
                        help="judge each mode again on seeds 1..N of the scenarios where it "
                             "misses (default 0: not)")
    parser.add_argument("--workers", type=int, default=WORKERS, help="processes (default 2)")
    parser.add_argument("--readme", type=Path,
                        help=f"put the trade-off table between {README_START!r} and "
                             f"{README_END!r} of this file")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    scenarios = {path.stem: load_scenario(path) for path in sorted(args.scenarios.glob("*.yml"))}
    print(f"running {len(scenarios)} scenarios ...", file=sys.stderr)
    results, cap_rps = run_scenarios(scenarios, args.workers, not args.skip_capacity)
    print(markdown(results))
    print("\nthe two refusal modes beside BentoML's rule:\n")
    print(trade_off(results))
    if args.readme:
        replace_block(args.readme, trade_off(results), README_START, README_END)
    print(f"\ncapacity (best fixed setting, p99 within the SLO): {cap_rps:.0f} req/s\n")
    print("\n".join(checks(results, cap_rps, scenarios)))
    print("\nthe targets of each mode (benchmarks/targets.py):")
    print("\n".join(target_lines(results, scenarios)))
    if args.seeds > 0:
        print(f"\nthe targets on seeds 1-{args.seeds}, for each mode on the scenarios where it "
              "misses one (on how many seeds each holds):")
        print("\n".join(seed_sweep(scenarios, results, args.seeds, args.workers)))
    print(f"\n{_refits(results)}")
    dump = _json(results, scenarios)
    if not args.skip_grid:
        print(f"running the grid ({len(grid.cells())} cells) ...", file=sys.stderr)
        cells = grid.run_grid(grid.cells(), args.workers)
        print("\ngrid summary, per mode and target (the worst cell is the one furthest past "
              "its bound):")
        print("\n".join(grid.summary(cells)))
        print(f"\n<details><summary>Every grid cell</summary>\n\ngrid: {len(cells)} cells, "
              "both modes against bentoml (benchmarks/grid.py)\n")
        print(grid.table(cells))
        print("\n</details>")
        dump["grid"] = [run.to_json() for run in cells]
    if args.json:
        args.json.write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
