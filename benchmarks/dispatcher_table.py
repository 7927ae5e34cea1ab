"""One command for the dispatcher results table in docs/dispatcher.md (issue #3).

    python -m benchmarks.dispatcher_table [--scenarios DIR] [--json FILE] [--skip-capacity]
                                          [--seeds N]

For every scenario it runs the adaptive policy, BentoML's rule, no batching, and the best fixed
(window, cap) pair found by a grid search in hindsight on that same traffic; it then finds the
capacity (the highest Poisson rate the best fixed setting serves with p99 within the SLO) and
checks the six points of issue #3 that a simulation can show, printing the numbers for each.
Point 5 is then run again on seeds 1..N (adaptive against BentoML only), to show which of its
verdicts hold beyond the scenario's own seed. Everything runs on the virtual clock, so the
table is the same on any machine for a given seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from runner.scenario import Scenario, load_scenario
from runner.simulate import Result, best_fixed, simulate

HERE = Path(__file__).parent
CAPACITY_BASE = "load_80"
CAPACITY_SECONDS = 30.0
CAPACITY_GRID = ((0.0, 1.0, 2.0, 5.0, 10.0), (64, 48, 32))
DYNAMIC = ("steps", "bursts", "cost_doubling")
SEEDS = 6


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
    """Bisect to 5 req/s on the best fixed setting's p99 (the definition in issue #3)."""
    while high - low > 5.0:
        middle = (low + high) / 2.0
        low, high = (middle, high) if fixed_meets_slo(scenario, middle) else (low, middle)
    return low


def against_bentoml(ours: Result, bento: Result) -> tuple[bool, bool]:
    """Point 5: (higher goodput, fewer false refusals); a tie counts only where nothing is lost."""
    lost = bento.requests - (bento.ok - bento.late)
    better = ours.goodput_rps > bento.goodput_rps or (
        lost == 0 and ours.goodput_rps >= bento.goodput_rps
    )
    fewer = ours.false_rejections < bento.false_rejections or (
        ours.false_rejections == 0 == bento.false_rejections
    )
    return better, fewer


def _pair(job: tuple[Scenario, int]) -> tuple[bool, bool]:
    scenario, seed = job
    return against_bentoml(simulate(scenario, "adaptive", seed=seed),
                           simulate(scenario, "bentoml", seed=seed))


def seed_sweep(scenarios: dict[str, Scenario], seeds: int) -> list[str]:
    """Point 5 on seeds 1..`seeds`: in how many the adaptive policy is ahead, per measure."""
    jobs = [(scenario, seed) for scenario in scenarios.values() for seed in range(1, seeds + 1)]
    with ProcessPoolExecutor() as pool:
        verdicts = list(pool.map(_pair, jobs))
    lines = []
    for index, name in enumerate(scenarios):
        mine = verdicts[index * seeds:(index + 1) * seeds]
        lines.append(f"- {name}: goodput ahead in {sum(g for g, _ in mine)}/{seeds}, "
                     f"fewer false refusals in {sum(f for _, f in mine)}/{seeds}, "
                     f"both in {sum(g and f for g, f in mine)}/{seeds}")
    return lines


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


def checks(results: dict[str, list[Result]], cap_rps: float, slo: dict[str, float]) -> list[str]:
    """The points of issue #3, each with its numbers and PASS or MISS."""
    out: list[str] = []

    def say(ok: bool, text: str) -> None:
        out.append(f"- {'PASS' if ok else 'MISS'}: {text}")

    def get(name: str, policy: str) -> Result:
        return next(run for run in results[name] if run.policy.startswith(policy))

    if "low_load" in results:
        low = get("low_load", "adaptive")
        single = 5.5  # ms: the median batch time of one item at 5 ms + 0.5 ms/item
        say(abs(low.p50_ms - single) <= 0.5,
            f"1. low load p50 {low.p50_ms:.2f} ms vs one item {single:.2f} ms (within 0.5 ms)")
    if "load_80" in results:
        run = get("load_80", "adaptive")
        say(run.p99_ms <= slo["load_80"] and run.rejected <= 0.005 * run.requests
            and run.late <= 0.001 * run.requests,
            f"2. 80% load p99 {run.p99_ms:.1f} ms, rejected {run.rejected}/{run.requests}, "
            f"late {run.late}")
    if "overload_150" in results:
        run = get("overload_150", "adaptive")
        say(run.goodput_rps >= 0.95 * cap_rps and run.late <= 0.001 * run.requests
            and run.rejected_at_arrival == run.rejected,
            f"3. overload goodput {run.goodput_rps:.1f} vs 95% of capacity "
            f"{0.95 * cap_rps:.1f}, late {run.late}/{run.requests}, refused at arrival "
            f"{run.rejected_at_arrival}/{run.rejected}")
    for name in DYNAMIC:
        if name in results:
            ours, fixed = get(name, "adaptive"), get(name, "fixed")
            say(ours.goodput_rps >= fixed.goodput_rps,
                f"4. {name}: goodput {ours.goodput_rps:.1f} vs best fixed {fixed.policy} "
                f"{fixed.goodput_rps:.1f}")
    for name in results:
        ours, bento = get(name, "adaptive"), get(name, "bentoml")
        better, fewer = against_bentoml(ours, bento)
        say(better and fewer,
            f"5. {name}: goodput {ours.goodput_rps:.1f} vs bentoml {bento.goodput_rps:.1f}; "
            f"false refusals {ours.false_rejections} vs {bento.false_rejections}")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatcher_table")
    parser.add_argument("--scenarios", type=Path, default=HERE / "scenarios")
    parser.add_argument("--json", type=Path, help="also write every result to this file")
    parser.add_argument("--skip-capacity", action="store_true",
                        help="assume 1700 req/s instead of searching for it (saves a minute)")
    parser.add_argument("--seeds", type=int, default=SEEDS,
                        help=f"run point 5 again on seeds 1..N (default {SEEDS}; 0 skips it)")
    args = parser.parse_args(argv)
    scenarios = {path.stem: load_scenario(path) for path in sorted(args.scenarios.glob("*.yml"))}
    results = {}
    for name, scenario in scenarios.items():
        print(f"running {name} ...", file=sys.stderr)
        results[name] = run_scenario(scenario)
    base = scenarios.get(CAPACITY_BASE)
    cap_rps = 1700.0 if args.skip_capacity or base is None else capacity(base)
    print(markdown(results))
    print(f"\ncapacity (best fixed setting, p99 within the SLO): {cap_rps:.0f} req/s\n")
    print("\n".join(checks(results, cap_rps, {n: s.slo_ms for n, s in scenarios.items()})))
    if args.seeds > 0:
        print(f"\npoint 5 on seeds 1-{args.seeds} (adaptive against bentoml):")
        print("\n".join(seed_sweep(scenarios, args.seeds)))
    refits = [run for runs in results.values() for run in runs if run.refits]
    mean = sum(run.refit_ms_mean * run.refits for run in refits) / sum(r.refits for r in refits)
    print(f"\nrefits: {sum(r.refits for r in refits)}, mean {mean:.2f} ms, "
          f"max {max(r.refit_ms_max for r in refits):.2f} ms (wall clock, this machine)")
    if args.json:
        args.json.write_text(json.dumps(
            {name: [run.to_json() for run in runs] for name, runs in results.items()}, indent=1
        ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
