"""The example models live: the latency model against their batches, and the plan against a run.

For each model of ``examples/models.yml`` named (``--models resnet,encoder``):

1. **The fit.** A fresh server on that configuration, writing its batch log, is warmed up and
   driven open-loop (binary requests: one image, or one sequence of ``--tokens`` ids) at
   each of the model's rates for ``--seconds``, so that batches of several sizes occur. Every
   batch after the warm-up is grouped by size (1, 2, 3-4, 5-8, ... requests): how many, their
   observed p50 and p99 wall time, the median of the high-quantile time the latency model
   predicted for them when they were released, and the p99 of each batch's observed over
   predicted time ("ratio p99", as in the live table: within [0.67, 1.5] the model held).
2. **The plan.** ``batchserve plan`` on that batch log, told the client's CPU per request and
   the server's outside the model (measured over the same runs), tries 1 and 2 runner
   processes and three batch caps at the model's target rate and recommends the smallest
   setting that carries it. A fresh server at that setting is then swept upwards from 70% of
   the rate the plan says it passes (its knee) until two rates in a row fail: a run passes
   with at most 1% non-OK and the p99 of the OK answers within the model's limit. The table
   sets the plan's knee beside the highest rate passed, and the plan's goodput at the target
   beside the run's (OK answers within the limit per second); within 25% confirms the plan.

    python -m benchmarks.model_table [--models resnet,encoder] [--doc docs/performance.md]

About 4 minutes a model. Run it from the repository root, under the bench lock on a shared
machine: other work on the cores slows the batches, and the predictions follow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from batchserve.api.bench import requests
from batchserve.api.bench.cpu import TICK, cpu_between, tree_cpu
from batchserve.api.bench.load_result import LoadResult
from batchserve.api.bench.loadgen import loop_factory, run_load
from batchserve.api.bench.scrape import fetch
from batchserve.api.bench.server import batchserve_command, serve
from batchserve.runner.sim.plan_cli import BATCH_MS, INTERCEPT, SLOPE
from benchmarks.live_report import num
from benchmarks.live_table import replace_block
from benchmarks.model_fit import Logged, SizeRow, by_size, markdown, parse

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "models.yml"


def markers(part: str, model: str) -> tuple[str, str]:
    """The lines between which `--doc` puts one model's `part` (fit or plan)."""
    return f"<!-- model-{part} {model}: start -->", f"<!-- model-{part} {model}: end -->"


MAX_NON_OK = 0.01
WITHIN = 0.25
"""How far the plan may be from the live run, as a share of the live figure."""
SWEEP = (0.5, 0.65, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)
"""The rates of the live check, as shares of the plan's knee: steps of 10 to 15% near it, so
that a knee within 25% of the plan's is told from one outside it."""
TRIES = 3
"""Runs at most at one rate, which passes when most of them pass: on a machine others share
one run's p99 moves by half from run to run, so a failure is run again and a third run
settles a split."""
NO_GRPC = ("--grpc-port", "0")
FLUSH_S = 2.0
"""A runner writes its batch log out every second while it runs batches: this long after a
run its every batch is on disk."""


@dataclass(frozen=True)
class Model:
    """What a model is driven with: its rates for the fit, its target for the plan, the rows
    of a request (one, or one sequence's tokens) and the batch caps the plan tries."""

    name: str
    rates: tuple[float, ...]
    target: float
    unit: int = 1
    caps: tuple[int, ...] = ()


MODELS = {
    "resnet": Model("resnet", (3.0, 8.0, 14.0, 20.0), 8.0, 1, (4, 8, 16)),
    "encoder": Model("encoder", (30.0, 120.0, 240.0), 120.0, 64, (512, 1024, 2048)),
}


@dataclass(frozen=True)
class Run:
    """One open-loop run: its rate, what came back, and whether it passed."""

    rate: float
    load: LoadResult
    limit_ms: float

    @property
    def non_ok(self) -> float:
        return (self.load.sent - self.load.ok) / self.load.sent if self.load.sent else 1.0

    @property
    def passed(self) -> bool:
        p99 = self.load.ok_p99_ms
        return self.non_ok <= MAX_NON_OK and p99 is not None and p99 <= self.limit_ms


def verdicts(runs: Sequence[Run]) -> dict[float, bool]:
    """Each rate run, and whether most of its runs passed."""
    tally: dict[float, list[bool]] = {}
    for run in runs:
        tally.setdefault(run.rate, []).append(run.passed)
    return {rate: 2 * sum(passes) > len(passes) for rate, passes in tally.items()}


def knee(runs: Sequence[Run]) -> float | None:
    """The highest rate passed below the lowest that failed (None if the first failed); a
    rate passes when most of its runs do."""
    judged = verdicts(runs)
    failed = min((rate for rate, ok in judged.items() if not ok), default=float("inf"))
    passed = [rate for rate, ok in judged.items() if ok and rate < failed]
    return max(passed) if passed else None


def within(planned: float | None, live: float | None) -> bool:
    """Whether the plan's figure is within `WITHIN` of the live one."""
    if not planned or not live:
        return False
    return abs(planned / live - 1.0) <= WITHIN


@dataclass(frozen=True)
class Fitted:
    """The fit part of one model: its rows by size, the runs, and what the server spent."""

    model: str
    rows: tuple[SizeRow, ...]
    runs: tuple[Run, ...]
    log: Path
    client_ms: float
    front_ms: float
    line: tuple[float, float, float]
    busy_cores: float
    """What else ran on the machine meanwhile (other processes than the server and the
    load generator), in cores."""


@dataclass(frozen=True)
class Checked:
    """The plan for one model and the live sweep at the setting it recommends."""

    model: str
    target: float
    processes: int
    cap: int
    planned_knee: float
    planned_goodput: float
    planned_busy: float
    """What else ran on the machine during the fit, in cores: the plan was told it."""
    runs: tuple[Run, ...] = field(default=())
    busy_cores: float = 0.0
    """What else ran on the machine during the live sweep, in cores."""

    @property
    def live_knee(self) -> float | None:
        return knee(self.runs)

    @property
    def live_goodput(self) -> float | None:
        at = [r.load.goodput for r in self.runs if r.rate == self.target]
        return statistics.median(at) if at else None


# --- driving a server -----------------------------------------------------------------------


class Driver:
    """Open-loop binary requests of one model, on one event loop runner."""

    def __init__(self, runner: asyncio.Runner, base: str, model: Model, limit_ms: float,
                 tokens: int) -> None:
        described = requests.metadata(base, model.name)
        self.body, self.headers = requests.request_body(
            described, elements=tokens, binary=True, seed=1)
        self.url = f"{base}/v2/models/{model.name}/infer"
        self.runner, self.limit_ms = runner, limit_ms

    def run(self, rate: float, seconds: float, seed: int) -> Run:
        load = self.runner.run(run_load(self.url, self.body, self.headers, rate, seconds, seed,
                                        slo_ms=self.limit_ms))
        run = Run(rate, load, self.limit_ms)
        print(f"  {rate:g} req/s: sent {load.sent}, non-OK {100 * run.non_ok:.2f}%, "
              f"p99 {num(load.ok_p99_ms, 0)} ms, refused {load.retry_after_by_reason}",
              file=sys.stderr, flush=True)
        return run


def limit_ms(config: Path, name: str) -> float:
    document = yaml.safe_load(config.read_text())
    return float(document["runners"][name]["batching"]["max_latency_ms"])


def logged(folder: Path, name: str) -> list[Logged]:
    return [batch for path in sorted(folder.glob(f"{name}-*.csv"))
            for batch in parse(path.read_text().splitlines())]


def cpu_seconds(folder: Path, name: str) -> float:
    """The model's CPU over every batch logged."""
    return sum(float(line.split(",")[2]) for path in sorted(folder.glob(f"{name}-*.csv"))
               for line in path.read_text().splitlines()[1:] if line)


def fit(model: Model, args: argparse.Namespace, runner: asyncio.Runner) -> Fitted:
    folder = args.logs / f"fit-{model.name}"
    batches = folder / "batches"
    batches.mkdir(parents=True)
    env = dict(os.environ, BATCHSERVE_BATCH_LOG=str(batches))
    run_args = argparse.Namespace(**vars(args), config=CONFIG)
    limit = limit_ms(CONFIG, model.name)
    with serve(run_args, folder / "server.log", cwd=ROOT, env=env, extra=NO_GRPC) as (base, pid):
        drive = Driver(runner, base, model, limit, args.tokens)
        drive.run(model.rates[0], args.warmup_seconds, seed=999)
        time.sleep(FLUSH_S)
        skip, cpu_before = len(logged(batches, model.name)), cpu_seconds(batches, model.name)
        before, machine_before, began = tree_cpu(pid), machine_cpu_s(), time.monotonic()
        runs = tuple(drive.run(rate, args.seconds, seed=i) for i, rate in enumerate(model.rates))
        server_s = cpu_between(before, tree_cpu(pid)).seconds
        machine_s, elapsed = machine_cpu_s() - machine_before, time.monotonic() - began
        line = fitted_line(base, model.name)
        time.sleep(FLUSH_S)
        measured = logged(batches, model.name)[skip:]
        model_s = cpu_seconds(batches, model.name) - cpu_before
    sent = sum(r.load.sent for r in runs)
    client_s = sum(r.load.loadgen_cpu_s for r in runs)
    client_ms = 1000 * client_s / max(sent, 1)
    busy = max(0.0, machine_s - server_s - client_s) / elapsed
    front = max(0.0, (1000 * (server_s - model_s) - BATCH_MS * len(measured)) / max(sent, 1))
    return Fitted(model.name, tuple(by_size(model.name, measured, model.unit)), runs, batches,
                  client_ms, front, line, busy)


def machine_cpu_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (`/proc/stat`)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _, _, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICK


def fitted_line(base: str, name: str) -> tuple[float, float, float]:
    """The runner's latency model at the end: intercept and slope of its mean wall time (ms,
    ms a row) and its stretch."""
    reading = fetch(base)
    return (1000 * reading.total(INTERCEPT, runner=name), 1000 * reading.total(SLOPE, runner=name),
            reading.total("batchserve_latency_model_stretch", runner=name))


def plan(model: Model, fitted: Fitted) -> Checked:
    """`batchserve plan` on the fit's batch log: its recommended setting, knee and goodput."""
    command = [*batchserve_command(), "plan", "--batch-log", str(fitted.log), "--config",
               str(CONFIG), "--runner", model.name, "--target", f"{model.target:g}",
               "--processes", "1,2", "--max-batch-sizes", ",".join(map(str, model.caps)),
               "--rows", str(model.unit), "--client-ms", f"{fitted.client_ms:.3f}",
               "--front-ms", f"{fitted.front_ms:.3f}",
               "--busy-cores", f"{fitted.busy_cores:.2f}", "--json"]
    report = json.loads(subprocess.run(command, capture_output=True, text=True,
                                       check=True).stdout)
    # With none that carries the target, the setting that passes the most is checked.
    chosen = report["recommended"] or max(report["settings"], key=lambda s: s["passing_rps"])
    setting = next(s for s in report["settings"] if s["processes"] == chosen["processes"]
                   and s["max_batch_size"] == chosen["max_batch_size"])
    return Checked(model.name, model.target, setting["processes"], setting["max_batch_size"],
                   float(setting["passing_rps"]), float(setting["target"]["goodput_rps"]),
                   fitted.busy_cores)


def config_with(model: Model, checked: Checked, folder: Path) -> Path:
    """The example configuration with the model at the plan's setting."""
    document = yaml.safe_load(CONFIG.read_text())
    runner = document["runners"][model.name]
    runner["workers"] = checked.processes
    key = "max_batch_elements" if "max_batch_elements" in runner["batching"] else \
        "max_batch_size"
    runner["batching"][key] = checked.cap
    path = folder / "configuration.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def check(model: Model, checked: Checked, args: argparse.Namespace,
          runner: asyncio.Runner) -> Checked:
    """The live sweep at the plan's setting, upwards until two rates in a row fail, and at
    the target whatever happens."""
    folder = args.logs / f"plan-{model.name}"
    folder.mkdir(parents=True)
    run_args = argparse.Namespace(**vars(args), config=config_with(model, checked, folder))
    rates = sorted({round(share * checked.planned_knee, 1) for share in SWEEP} | {model.target})
    runs: list[Run] = []
    previous, stopped = 0.0, False
    with serve(run_args, folder / "server.log", cwd=ROOT, extra=NO_GRPC) as (base, pid):
        drive = Driver(runner, base, model, limit_ms(CONFIG, model.name), args.tokens)
        drive.run(model.rates[0], args.warmup_seconds, seed=999)
        before, machine_before, began = tree_cpu(pid), machine_cpu_s(), time.monotonic()
        for rate in rates:
            if stopped and rate != model.target:
                continue  # past two failures in a row, only the target is still run
            passed = trial(drive, rate, args.seconds, runs)
            stopped = stopped or (not passed and not verdicts(runs).get(previous, True))
            previous = rate
        server_s = cpu_between(before, tree_cpu(pid)).seconds
        machine_s, elapsed = machine_cpu_s() - machine_before, time.monotonic() - began
    client_s = sum(r.load.loadgen_cpu_s for r in runs)
    busy = max(0.0, machine_s - server_s - client_s) / elapsed
    return Checked(**{**vars(checked), "runs": tuple(runs), "busy_cores": busy})


def trial(drive: Driver, rate: float, seconds: float, runs: list[Run]) -> bool:
    """Up to `TRIES` runs at `rate`, until most of them are known to pass or fail."""
    passes = fails = 0
    while 2 * passes <= TRIES and 2 * fails <= TRIES:
        runs.append(drive.run(rate, seconds, seed=len(runs) + 100))
        passes, fails = passes + runs[-1].passed, fails + (not runs[-1].passed)
        if passes > fails:
            return True
    return False


# --- the tables -----------------------------------------------------------------------------


def _rate(value: float | None) -> str:
    return "none" if value is None else f"{value:,.1f}"


def plan_markdown(checks: Sequence[Checked]) -> str:
    lines = ["| model | target req/s | recommended: processes, cap | plan knee req/s | "
             "live knee req/s | plan / live | plan goodput at target | live goodput at "
             "target | plan / live | within 25% | other work, cores: fit, live |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for c in checks:
        live_knee, live_good = c.live_knee, c.live_goodput
        knee_ratio = c.planned_knee / live_knee if live_knee else None
        good_ratio = c.planned_goodput / live_good if live_good else None
        ok = within(c.planned_knee, live_knee) and within(c.planned_goodput, live_good)
        lines.append(
            f"| {c.model} | {c.target:g} | {c.processes}, {c.cap} | {c.planned_knee:,.1f} | "
            f"{_rate(live_knee)} | {num(knee_ratio, 2)} | {c.planned_goodput:,.1f} | "
            f"{_rate(live_good)} | {num(good_ratio, 2)} | {'yes' if ok else '**no**'} | "
            f"{c.planned_busy:.2f}, {c.busy_cores:.2f} |")
    return "\n".join(lines)


def sweep_markdown(checks: Sequence[Checked]) -> str:
    lines = ["| model | rate req/s | sent | non-OK % | p50 ms | p99 ms | goodput req/s | "
             "passed |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in checks:
        for r in c.runs:
            lines.append(f"| {c.model} | {r.rate:g} | {r.load.sent} | {100 * r.non_ok:.2f} | "
                         f"{num(r.load.ok_p50_ms, 0)} | {num(r.load.ok_p99_ms, 0)} | "
                         f"{r.load.goodput:.1f} | {'yes' if r.passed else 'no'} |")
    return "\n".join(lines)


def fit_summary(fits: Sequence[Fitted]) -> str:
    lines = []
    for f in fits:
        rates = ", ".join(f"{r.rate:g}" for r in f.runs)
        held = sum(row.holds for row in f.rows)
        intercept, slope, stretch = f.line
        lines.append(f"{f.model} at {rates} req/s: ratio p99 within [0.67, 1.5] in "
                     f"{held}/{len(f.rows)} sizes; the line at the end {intercept:.2f} ms + "
                     f"{slope:.3f} ms a row (stretch {stretch:.2f}); client {f.client_ms:.2f} "
                     f"ms/req, server outside the model {f.front_ms:.2f} ms/req, other work "
                     f"on the machine {f.busy_cores:.2f} cores")
    return "\n".join(lines)


# --- the command ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet,encoder")
    p.add_argument("--seconds", type=float, default=12.0, help="length of each run")
    p.add_argument("--warmup-seconds", type=float, default=4.0)
    p.add_argument("--tokens", type=int, default=64, help="ids in an encoder request")
    p.add_argument("--skip-plan", action="store_true", help="the fit only")
    p.add_argument("--api-workers", type=int, default=2)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, help="write every figure to this file")
    start, end = markers("fit", "MODEL")
    p.add_argument("--doc", type=Path, help="also put each model's tables in this file "
                   f"between {start!r} and {end!r}, and likewise model-plan")
    args = p.parse_args(argv)
    args.port = 0
    args.logs = Path(tempfile.mkdtemp(prefix=f"batchserve-models-{os.getpid()}-"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    fits, checks = [], []
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        for name in args.models.split(","):
            model = MODELS[name]
            print(f"{name}: the fit", file=sys.stderr, flush=True)
            fits.append(fit(model, args, runner))
            if not args.skip_plan:
                planned = plan(model, fits[-1])
                print(f"{name}: plan {planned}; the live check", file=sys.stderr, flush=True)
                checks.append(check(model, planned, args, runner))
    for f in fits:
        text = f"{markdown(f.rows)}\n\n{fit_summary([f])}"
        print(f"{text}\n")
        if args.doc:
            replace_block(args.doc, text, *markers("fit", f.model))
    for c in checks:
        text = f"{plan_markdown([c])}\n\n{sweep_markdown([c])}"
        print(f"{text}\n")
        if args.doc:
            replace_block(args.doc, text, *markers("plan", c.model))
    print(f"server logs: {args.logs}")
    if args.json:
        args.json.write_text(json.dumps({
            "fit": [{"model": f.model, "rows": [r.as_dict() for r in f.rows],
                     "client_ms": f.client_ms, "front_ms": f.front_ms} for f in fits],
            "plan": [{"model": c.model, "processes": c.processes, "cap": c.cap,
                      "planned_knee": c.planned_knee, "live_knee": c.live_knee,
                      "planned_goodput": c.planned_goodput, "live_goodput": c.live_goodput,
                      "runs": [{"rate": r.rate, "passed": r.passed, **r.load.as_dict()}
                               for r in c.runs]} for c in checks]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
