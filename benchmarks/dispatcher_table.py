"""One command for the dispatcher results in docs/dispatcher.md.

    python -m benchmarks.dispatcher_table [--scenarios DIR] [--json FILE] [--skip-capacity]
                                          [--skip-grid] [--seeds N] [--workers N]

For every scenario it runs the adaptive policy, BentoML's rule, no batching, and the best fixed
(window, cap) pair found by a grid search in hindsight on that same traffic; it then finds the
capacity (the highest Poisson rate the best fixed setting serves with p99 within the SLO),
checks the behaviour at low load, at 80% load, in overload and under changing traffic, and the
targets against BentoML's rule (`benchmarks.targets`) on every scenario, and runs the generated
grid (`benchmarks.grid`) with a summary of the worst cell per target. `--seeds N` runs the
targets against BentoML's rule again on seeds 1..N of every scenario.
Everything runs on the virtual clock, so the output is the same on any machine for a given
seed, except the refit times measured on the wall clock.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from batchserve.runner.sim.scenario import Scenario, load_scenario
from batchserve.runner.sim.simulate import Result, best_fixed, simulate
from benchmarks import grid
from benchmarks.targets import TARGETS, lines, verdicts

HERE = Path(__file__).parent
CAPACITY_BASE = "load_80"
CAPACITY_SECONDS = 30.0
CAPACITY_GRID = ((0.0, 1.0, 2.0, 5.0, 10.0), (64, 48, 32))
DYNAMIC = ("steps", "bursts", "cost_doubling")
WORKERS = 2


def run_scenario(scenario: Scenario) -> list[Result]:
    """Adaptive, BentoML, no batching and the best fixed pair, on the same arrivals."""
    runs = [simulate(scenario, kind) for kind in ("adaptive", "bentoml", "none")]
    runs.append(best_fixed(scenario)[2])
    return runs


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


def _pair(job: tuple[Scenario, int]) -> list[bool]:
    scenario, seed = job
    found = verdicts(simulate(scenario, "adaptive", seed=seed),
                     simulate(scenario, "bentoml", seed=seed), scenario.slo_ms)
    return [verdict.ok for verdict in found]


def seed_sweep(scenarios: dict[str, Scenario], seeds: int, workers: int) -> list[str]:
    """The targets against BentoML's rule on seeds 1..`seeds`: on how many each target holds,
    per scenario."""
    jobs = [(scenario, seed) for scenario in scenarios.values() for seed in range(1, seeds + 1)]
    with ProcessPoolExecutor(workers) as pool:
        found = list(pool.map(_pair, jobs))
    out = []
    for index, name in enumerate(scenarios):
        mine = found[index * seeds:(index + 1) * seeds]
        counts = ", ".join(f"{target} {sum(ok[i] for ok in mine)}/{seeds}"
                           for i, target in enumerate(TARGETS))
        out.append(f"- {name}: {counts}")
    return out


def markdown(results: dict[str, list[Result]]) -> str:
    lines = [
        "| scenario | policy | goodput req/s | p50 ms | p99 ms | rejected % | late % "
        "| false rej. | mean batch | refusal wait p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        for run in runs:
            share = 100.0 / run.requests if run.requests else 0.0
            lines.append(
                f"| {name} | {run.policy} | {run.goodput_rps:.1f} | {run.p50_ms:.2f} "
                f"| {run.p99_ms:.1f} | {run.rejected * share:.2f} | {run.late * share:.3f} "
                f"| {run.false_rejections} | {run.mean_batch_size:.1f} "
                f"| {run.reject_wait_p99_ms:.1f} |"
            )
    return "\n".join(lines)


def one_request_ms(scenario: Scenario) -> float:
    """The median time of a batch of one request on the scenario's first cost: the lognormal
    noise on it has median 1, so this is the cost curve's own value."""
    return scenario.phases[0].cost.mean_s(scenario.size_min) * 1000.0


def checks(
    results: dict[str, list[Result]], cap_rps: float, scenarios: dict[str, Scenario]
) -> list[str]:
    """The checks at low load, 80% load, overload and changing traffic, then the targets against
    BentoML's rule, each with its numbers and PASS or MISS."""
    out: list[str] = []
    slo = {name: scenario.slo_ms for name, scenario in scenarios.items()}

    def say(ok: bool, text: str) -> None:
        out.append(f"- {'PASS' if ok else 'MISS'}: {text}")

    def get(name: str, policy: str) -> Result:
        return next(run for run in results[name] if run.policy.startswith(policy))

    if "low_load" in results:
        low = get("low_load", "adaptive")
        single = one_request_ms(scenarios["low_load"])
        say(abs(low.p50_ms - single) <= 0.5,
            f"low load: p50 {low.p50_ms:.2f} ms vs one item {single:.2f} ms (within 0.5 ms)")
    if "load_80" in results:
        run = get("load_80", "adaptive")
        say(run.p99_ms <= slo["load_80"] and run.rejected <= 0.005 * run.requests
            and run.late <= 0.001 * run.requests,
            f"80% load: p99 {run.p99_ms:.1f} ms, rejected {run.rejected}/{run.requests}, "
            f"late {run.late}")
    if "overload_150" in results:
        run = get("overload_150", "adaptive")
        say(run.goodput_rps >= 0.95 * cap_rps and run.late <= 0.001 * run.requests
            and run.rejected_at_arrival == run.rejected,
            f"overload: goodput {run.goodput_rps:.1f} vs 95% of capacity "
            f"{0.95 * cap_rps:.1f}, late {run.late}/{run.requests}, refused at arrival "
            f"{run.rejected_at_arrival}/{run.rejected}")
    for name in DYNAMIC:
        if name in results:
            ours, fixed = get(name, "adaptive"), get(name, "fixed")
            say(ours.goodput_rps >= fixed.goodput_rps,
                f"{name}: goodput {ours.goodput_rps:.1f} vs best fixed {fixed.policy} "
                f"{fixed.goodput_rps:.1f}")
    for name in results:
        ours, bento = get(name, "adaptive"), get(name, "bentoml")
        out.extend(lines(name, verdicts(ours, bento, slo[name])))
    return out


def run_scenarios(
    scenarios: dict[str, Scenario], workers: int, search_capacity: bool
) -> tuple[dict[str, list[Result]], float]:
    """Every scenario's runs, and the capacity (searched beside them, or assumed 1700 req/s)."""
    base = scenarios.get(CAPACITY_BASE)
    with ProcessPoolExecutor(workers) as pool:
        found = pool.submit(capacity, base) if search_capacity and base is not None else None
        runs = dict(zip(scenarios, pool.map(run_scenario, scenarios.values()), strict=True))
        return runs, 1700.0 if found is None else found.result()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatcher_table")
    parser.add_argument("--scenarios", type=Path, default=HERE / "scenarios")
    parser.add_argument("--json", type=Path, help="also write every result to this file")
    parser.add_argument("--skip-capacity", action="store_true",
                        help="assume 1700 req/s instead of searching for it (saves a minute)")
    parser.add_argument("--skip-grid", action="store_true", help="do not run the grid")
    parser.add_argument("--seeds", type=int, default=0,
                        help="run the targets against bentoml again on seeds 1..N (default 0: not)")
    parser.add_argument("--workers", type=int, default=WORKERS, help="processes (default 2)")
    args = parser.parse_args(argv)
    scenarios = {path.stem: load_scenario(path) for path in sorted(args.scenarios.glob("*.yml"))}
    print(f"running {len(scenarios)} scenarios ...", file=sys.stderr)
    results, cap_rps = run_scenarios(scenarios, args.workers, not args.skip_capacity)
    print(markdown(results))
    print(f"\ncapacity (best fixed setting, p99 within the SLO): {cap_rps:.0f} req/s\n")
    print("\n".join(checks(results, cap_rps, scenarios)))
    if args.seeds > 0:
        print(f"\nthe targets on seeds 1-{args.seeds} (on how many seeds each holds, "
              "adaptive against bentoml):")
        print("\n".join(seed_sweep(scenarios, args.seeds, args.workers)))
    refits = [run for runs in results.values() for run in runs if run.refits]
    mean = sum(run.refit_ms_mean * run.refits for run in refits) / sum(r.refits for r in refits)
    print(f"\nrefits: {sum(r.refits for r in refits)}, mean {mean:.2f} ms, "
          f"max {max(r.refit_ms_max for r in refits):.2f} ms (wall clock, this machine)")
    dump = {name: [run.to_json() for run in runs] for name, runs in results.items()}
    if not args.skip_grid:
        print(f"running the grid ({len(grid.cells())} cells) ...", file=sys.stderr)
        cells = grid.run_grid(grid.cells(), args.workers)
        print(f"\ngrid: {len(cells)} cells, adaptive against bentoml (benchmarks/grid.py)\n")
        print(grid.table(cells))
        print("\ngrid summary, per target (the worst cell is the one furthest past its bound):")
        print("\n".join(grid.summary(cells)))
        dump["grid"] = [{"cell": run.cell.name, "adaptive": run.adaptive.to_json(),
                         "bentoml": run.bentoml.to_json()} for run in cells]
    if args.json:
        args.json.write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
