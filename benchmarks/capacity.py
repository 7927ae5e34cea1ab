"""The capacity gauge and `batchserve plan` against the rate the server really passes.

For each client and each number of `mlp` runner processes (``--processes 1,2``: the bundled
configuration with `workers` set), ``--repeats`` trials (3), each on a fresh server writing its
batch log: it is warmed up and driven at ``--read-rate`` (800 req/s) for 15 s, and the
runner's capacity (``batchserve_capacity_requests_per_second``, summed over its processes) is
read at the end of that run. The same server is then swept upwards through ``--rates`` until
two rates in a row fail, and then half-way between the highest rate that passed and the
lowest that failed above it until they are at most 200 req/s apart. A run passes with at most
1% non-OK and the p99 of the OKs within 100 ms, as in the live table; a rate passes when most
of its runs do (a failed run is run again, and a third run settles a split). The highest rate
that passed is what both should have said. Last, `batchserve plan` runs on that server's batch
log, for that many processes, told what the sweep measured: the client's CPU per request (it
runs on the same cores) and the server's outside the model near its capacity (`front_ms`: what
a request costs the server depends on the client's requests). The table judges the trials'
medians: on a machine others share, one sweep's passing rate moves by a third from run to
run.

The clients: ``batchserve`` (this project's generator) and ``fastload`` (the shared light
client); ``loadgen`` (the shared aiohttp client) on request. On two cores ``loadgen`` falls
behind its own schedule from about 2,000 req/s (its send lag alone passes the limit), so what
it passes there measures the client; the table's last column, the client's send lag p99 at
the first rate that failed, shows which side failed.

    python -m benchmarks.capacity [--processes 1,2] [--clients batchserve,fastload,loadgen]
        [--repeats 3] [--rates 1200,1600,...] [--doc docs/monitoring.md]

About 30 minutes with the defaults. Run it from the repository root, under the bench lock on
a shared machine: other work on the cores lowers what passes, and only the gauge sees it.
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from batchserve.api.bench.loadgen import loop_factory
from batchserve.api.bench.scrape import fetch
from batchserve.api.bench.server import batchserve_command, serve
from batchserve.runner.metrics import CAPACITY_SMOOTHING_S
from batchserve.runner.sim.plan_cli import BATCH_MS
from benchmarks.live_clients import Client, OwnClient, RunResult, SharedClient
from benchmarks.live_table import observed, replace_block

ROOT = Path(__file__).resolve().parent.parent
READ_S = 3 * CAPACITY_SMOOTHING_S
"""How long the rate the gauge is read at runs first: the gauge averages the last seconds with
this time constant, so after three of them what came before (the warm-up) weighs 5%."""
RUNNER = "mlp"
CAPACITY = "batchserve_capacity_requests_per_second"
NEAR_CAPACITY = 0.75
"""The runs that tell the plan what the server costs a request near its capacity: those that
passed at this share of the highest rate passed or more."""
DOC_START = "<!-- capacity-check: start -->"
DOC_END = "<!-- capacity-check: end -->"


TRIES = 3
"""Runs at most at one rate, which passes when most of them pass. On a machine others share
one 8-second run's p99 at one rate, on one server, moves from 45 to 140 ms (a scheduling
hiccup), so one failed run says little: a failure is run again, and a third run settles a
split."""


def verdicts(runs: Sequence[RunResult]) -> dict[float, bool]:
    """Each rate run, and whether most of its runs passed."""
    tally: dict[float, list[bool]] = {}
    for run in runs:
        tally.setdefault(run.rate, []).append(run.passed)
    return {rate: 2 * sum(passes) > len(passes) for rate, passes in tally.items()}


@dataclass(frozen=True)
class Trial:
    """One fresh server: the gauge, the sweep after it, and the plan's rate."""

    capacity: float
    sweep: tuple[RunResult, ...]
    planned: float | None = None
    client_ms: float = 0.0  # the client's CPU per request over the sweep, told to the plan
    front_ms: float | None = None  # the server's outside the model near capacity, told too

    @property
    def passed_rate(self) -> float | None:
        """The highest rate most of whose runs passed."""
        passed = [rate for rate, ok in verdicts(self.sweep).items() if ok]
        return max(passed) if passed else None

    @property
    def failed(self) -> RunResult | None:
        """The first failed run at the lowest rate above the highest rate passed."""
        top = self.passed_rate or 0.0
        above = [rate for rate, ok in verdicts(self.sweep).items() if rate > top and not ok]
        if not above:
            return None
        return next(run for run in self.sweep if run.rate == min(above) and not run.passed)


@dataclass(frozen=True)
class Check:
    """One client on one number of runner processes: a trial per fresh server, judged on
    their medians, since on a machine others share one sweep's passing rate moves by a
    third from run to run."""

    client: str
    processes: int
    trials: tuple[Trial, ...]

    @property
    def capacity(self) -> float:
        return statistics.median(t.capacity for t in self.trials)

    @property
    def planned(self) -> float | None:
        plans = [t.planned for t in self.trials if t.planned]
        return statistics.median(plans) if plans else None

    @property
    def passed_rate(self) -> float | None:
        rates = [t.passed_rate or 0.0 for t in self.trials]
        return statistics.median(rates) or None

    @property
    def client_ms(self) -> float:
        return statistics.median(t.client_ms for t in self.trials)

    @property
    def front_ms(self) -> float | None:
        fronts = [t.front_ms for t in self.trials if t.front_ms is not None]
        return statistics.median(fronts) if fronts else None

    @property
    def median_trial(self) -> Trial:
        """The trial whose passing rate is the median (the lower one of an even count)."""
        ranked = sorted(self.trials, key=lambda t: t.passed_rate or 0.0)
        return ranked[(len(ranked) - 1) // 2]

    def against(self, rate: float | None) -> float | None:
        """`rate` over the median rate passed."""
        passed = self.passed_rate
        return rate / passed if passed and rate else None


@dataclass(frozen=True)
class ServerCost:
    """What the server spent on one run: its CPU per request outside the model thread, for
    how many requests and batches."""

    rate: float
    passed: bool
    outside_model_ms: float
    requests: int
    batches: int


class Metered:
    """`client`, each of whose runs also measures the server's CPU outside the model: its
    whole process tree's, less the model thread's (from the runner's metrics)."""

    def __init__(self, client: Client, base: str, pid: int) -> None:
        self.client, self.name, self._base, self._pid = client, client.name, base, pid
        self.costs: list[ServerCost] = []

    def run(self, url: str, rate: float, seconds: float, seed: int) -> RunResult:
        (result,), seen = observed(self._base, self._pid,
                                   lambda: (self.client.run(url, rate, seconds, seed),))
        outside = (seen.cpu_ms_per_req or 0.0) - (seen.model_cpu_ms_per_req or 0.0)
        self.costs.append(ServerCost(rate, result.passed, outside, result.sent, seen.batches))
        return result


def front_ms(costs: Sequence[ServerCost], batch_ms: float = BATCH_MS) -> float | None:
    """The server's CPU per request outside the model's batches near its capacity, as
    `batchserve plan --front-ms` takes it: over the runs that passed at `NEAR_CAPACITY` of
    the highest rate passed or more, less the part the plan counts per batch (`batch_ms`).
    What a request costs the server depends on the client's requests (a body twice as long
    takes longer to read and decode), so each client's is measured; None if none passed."""
    top = max((c.rate for c in costs if c.passed), default=None)
    if top is None:
        return None
    near = [c for c in costs if c.passed and c.rate >= NEAR_CAPACITY * top]
    requests = sum(c.requests for c in near)
    outside = sum(c.outside_model_ms * c.requests for c in near)
    return max(0.0, (outside - batch_ms * sum(c.batches for c in near)) / requests)


def sweep(client: Client, url: str, rates: Sequence[float], seconds: float,
          resolution: float = 200.0) -> list[RunResult]:
    """Rates upwards until two in a row fail; then, while the highest rate passed and the
    lowest failed above it are more than `resolution` apart, the rate half-way between. A
    rate fails when most of its runs (`TRIES` at most) fail."""
    runs: list[RunResult] = []

    def run(rate: float) -> bool:
        passes = 0
        for tries in range(1, TRIES + 1):
            runs.append(client.run(url, rate, seconds, seed=100 + len(runs)))
            passes += runs[-1].passed
            print(f"  {client.name} {rate:g} req/s: p99 {runs[-1].p99_ms} ms, "
                  f"non-OK {100 * runs[-1].non_ok:.2f}%", file=sys.stderr, flush=True)
            if passes > tries - passes or 2 * (tries - passes) >= TRIES:
                break  # a pass ahead, or most of the tries failed
        return passes > tries - passes

    failed_last = False
    for rate in rates:
        passed = run(rate)
        if failed_last and not passed:
            break
        failed_last = not passed
    while True:
        trial = Trial(0.0, tuple(runs))
        failed = trial.failed
        if failed is None or trial.passed_rate is None:
            return runs
        low, high = trial.passed_rate, failed.rate
        if high - low <= resolution:
            return runs
        run(round((low + high) / 2 / 100) * 100)


def config_with(processes: int, folder: Path, source: Path) -> Path:
    """`source` with the runner's `workers` set to `processes`."""
    document = yaml.safe_load(source.read_text())
    document["runners"][RUNNER]["workers"] = processes
    path = folder / f"configuration-{processes}.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def planned(logs: Path, config: Path, processes: int, client_ms: float,
            front: float | None) -> float:
    """The plan's passing rate for `processes` from the batch logs in `logs`, told the
    client's CPU per request and the server's outside the model (its default if None)."""
    command = [*batchserve_command(), "plan", "--batch-log", str(logs), "--config", str(config),
               "--runner", RUNNER, "--target", "1000", "--processes", str(processes),
               "--client-ms", f"{client_ms:.3f}", "--json"]
    if front is not None:
        command += ["--front-ms", f"{front:.3f}"]
    report = json.loads(subprocess.run(command, capture_output=True, text=True,
                                       check=True).stdout)
    [setting] = report["settings"]
    return float(setting["passing_rps"])


def check(client: Client, args: argparse.Namespace, processes: int) -> Check:
    return Check(client.name, processes,
                 tuple(trial(client, args, processes, index) for index in range(args.repeats)))


def trial(client: Client, args: argparse.Namespace, processes: int, index: int) -> Trial:
    folder = args.logs / f"{client.name}-{processes}-{index}"
    batches = folder / "batches"
    batches.mkdir(parents=True)
    run_args = argparse.Namespace(**vars(args))
    run_args.config = config_with(processes, folder, args.config)
    env = dict(os.environ, BATCHSERVE_BATCH_LOG=str(batches))
    with serve(run_args, folder / "server.log", cwd=ROOT, env=env) as (base, pid):
        url = f"{base}/v2/models/{RUNNER}/infer"
        client.run(url, 200.0, 3.0, seed=999)
        client.run(url, args.read_rate, READ_S, seed=1)
        capacity = fetch(base).total(CAPACITY, runner=RUNNER)
        print(f"  {client.name}, {processes} process(es), trial {index + 1}: capacity "
              f"{capacity:.0f} req/s read at {args.read_rate:g}", file=sys.stderr, flush=True)
        rates = [float(r) for r in args.rates.split(",")]
        metered = Metered(client, base, pid)
        runs = tuple(sweep(metered, url, rates, args.seconds))
    client_ms = 1000 * sum(r.client_cpu_s for r in runs) / max(sum(r.sent for r in runs), 1)
    front = front_ms(metered.costs)
    plan = planned(batches, run_args.config, processes, client_ms, front)
    return Trial(capacity, runs, plan, client_ms, front)


def _rate(rate: float | None) -> str:
    return f"{rate:,.0f}" if rate else "none"


def _ratio(ratio: float | None) -> str:
    return f"{ratio:.2f}" if ratio else "-"


def _ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f}"


def _failed(run: RunResult | None) -> str:
    if run is None:
        return "-"
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f} ms"
    return f"{run.rate:,.0f}: {ms(run.p99_ms)}, {ms(run.send_lag_p99_ms)}"


def markdown(checks: Sequence[Check], read_rate: float = 800.0) -> str:
    lines = [f"| client | runner processes | capacity read at {read_rate:,.0f} req/s | "
             "plan | highest rate passed (each trial) | capacity / passed | plan / passed | "
             "client CPU ms/req | server CPU ms/req outside the model | "
             "first rate failed: p99, client send lag p99 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in checks:
        each = ", ".join(_rate(t.passed_rate) for t in c.trials)
        lines.append(
            f"| {c.client} | {c.processes} | {c.capacity:,.0f} | {_rate(c.planned)} | "
            f"{_rate(c.passed_rate)} ({each}) | {_ratio(c.against(c.capacity))} | "
            f"{_ratio(c.against(c.planned))} | {c.client_ms:.2f} | {_ms(c.front_ms)} | "
            f"{_failed(c.median_trial.failed)} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configuration.yml")
    p.add_argument("--processes", default="1,2", help="numbers of mlp runner processes")
    p.add_argument("--api-workers", type=int, default=None,
                   help="API worker processes (default: the configuration's)")
    p.add_argument("--clients", default="batchserve,fastload",
                   help="some of batchserve, fastload, loadgen")
    p.add_argument("--read-rate", type=float, default=800.0)
    p.add_argument("--rates", default="1200,1600,2000,2400,2800,3200,3600,4000,4400,4800")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=3,
                   help="fresh servers per client and number of processes; medians count")
    p.add_argument("--shared-tools", type=Path, default=ROOT.parent / "shared/tools")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--doc", type=Path, help=f"also put the table in this file between "
                   f"{DOC_START!r} and {DOC_END!r}")
    args = p.parse_args(argv)
    args.port = 0
    args.logs = Path(tempfile.mkdtemp(prefix=f"batchserve-capacity-{os.getpid()}-"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    checks = []
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        tools = args.shared_tools
        table = {"batchserve": lambda: OwnClient(runner),
                 "fastload": lambda: SharedClient(tools / "fastload.py", name="fastload"),
                 "loadgen": lambda: SharedClient(tools / "loadgen.py", name="loadgen")}
        for name in args.clients.split(","):
            for processes in (int(p) for p in args.processes.split(",")):
                checks.append(check(table[name](), args, processes))
    text = markdown(checks, args.read_rate)
    print(text)
    if args.doc:
        replace_block(args.doc, text, DOC_START, DOC_END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
