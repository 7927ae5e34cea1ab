"""The capacity gauge against the rate the server really passes, on this machine.

For each client (batchserve's own generator, the shared aiohttp one), a fresh server on
``--config`` is warmed up and driven at ``--read-rate`` (800 req/s) for ``--seconds``; the
runner's capacity (``batchserve_capacity_requests_per_second``, summed over its processes)
is read at the end of that run. Then the same server is swept upwards through ``--rates``
until two rates in a row fail; the highest rate that passed (at most 1% non-OK, p99 of the
OKs within 100 ms, as in the live table) is what the gauge should have said.

    python -m benchmarks.capacity [--config configuration.yml] [--rates 1200,1600,...]
        [--doc docs/monitoring.md]

Run it from the repository root, under the bench lock on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from batchserve.api.bench.loadgen import loop_factory
from batchserve.api.bench.scrape import fetch
from batchserve.api.bench.server import serve
from benchmarks.live_clients import Client, OwnClient, RunResult, SharedClient
from benchmarks.live_table import replace_block

ROOT = Path(__file__).resolve().parent.parent
CAPACITY = "batchserve_capacity_requests_per_second"
DOC_START = "<!-- capacity-check: start -->"
DOC_END = "<!-- capacity-check: end -->"


@dataclass(frozen=True)
class Check:
    """One client's reading of the gauge and the sweep after it."""

    client: str
    read_rate: float
    capacity: float
    sweep: tuple[RunResult, ...]

    @property
    def passed_rate(self) -> float | None:
        passed = [run.rate for run in self.sweep if run.passed]
        return max(passed) if passed else None

    @property
    def ratio(self) -> float | None:
        rate = self.passed_rate
        return self.capacity / rate if rate else None


def sweep(client: Client, url: str, rates: Sequence[float], seconds: float) -> list[RunResult]:
    """Rates upwards until two in a row fail."""
    runs: list[RunResult] = []
    for index, rate in enumerate(rates):
        runs.append(client.run(url, rate, seconds, seed=100 + index))
        print(f"  {client.name} {rate:g} req/s: p99 {runs[-1].p99_ms} ms, "
              f"non-OK {100 * runs[-1].non_ok:.2f}%", file=sys.stderr, flush=True)
        if len(runs) >= 2 and not runs[-1].passed and not runs[-2].passed:
            break
    return runs


def check(client: Client, args: argparse.Namespace, runner: str) -> Check:
    log = args.logs / f"server-{client.name}.log"
    with serve(args, log, cwd=ROOT) as (base, _):
        url = f"{base}/v2/models/{runner}/infer"
        client.run(url, 200.0, 3.0, seed=999)
        client.run(url, args.read_rate, args.seconds, seed=1)
        capacity = fetch(base).total(CAPACITY, runner=runner)
        print(f"  {client.name}: capacity {capacity:.0f} req/s read at {args.read_rate:g}",
              file=sys.stderr, flush=True)
        runs = sweep(client, url, [float(r) for r in args.rates.split(",")], args.seconds)
    return Check(client.name, args.read_rate, capacity, tuple(runs))


def markdown(checks: Sequence[Check]) -> str:
    lines = ["| client | capacity read at 800 req/s | highest rate passed | capacity / passed |",
             "|---|---:|---:|---:|"]
    for c in checks:
        passed = f"{c.passed_rate:,.0f}" if c.passed_rate else "none"
        ratio = f"{c.ratio:.2f}" if c.ratio else "-"
        lines.append(f"| {c.client} | {c.capacity:,.0f} | {passed} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configuration.yml")
    p.add_argument("--runner", default="mlp")
    p.add_argument("--api-workers", type=int, default=2)
    p.add_argument("--clients", default="batchserve,shared", help="batchserve, shared or both")
    p.add_argument("--read-rate", type=float, default=800.0)
    p.add_argument("--rates", default="1200,1600,2000,2400,2800,3200,3600,4000,4800")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--shared-loadgen", type=Path, default=ROOT.parent / "shared/tools/loadgen.py")
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
        table = {"batchserve": lambda: OwnClient(runner),
                 "shared": lambda: SharedClient(args.shared_loadgen)}
        for name in args.clients.split(","):
            checks.append(check(table[name](), args, args.runner))
    text = markdown(checks)
    print(text)
    if args.doc:
        replace_block(args.doc, text, DOC_START, DOC_END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
