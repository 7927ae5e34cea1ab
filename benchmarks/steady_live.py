"""The live check on a steady model: a runner whose batch time is a fixed sleep, in both
refusal modes, at 0.8 and 1.5 times its capacity, under both shared clients.

    python -m benchmarks.steady_live [--seconds 20] [--loads 0.8,1.5] [--json FILE] [--doc FILE]

The model (`steady_rows` in `tests/fixture_models.py`) sleeps 3 ms plus 0.8 ms a row per
batch, so its batch time never varies: the case where a bias in the promises has no noise to
hide in (docs/dispatcher.md, decision 1). One runner serves it with `max_batch_size: 32` and
`max_latency_ms: 50`, 1.75 full batches, behind two API workers. Full batches back to back
serve 32 rows in 28.6 ms, `CAPACITY_RPS` (about 1,119 req/s); each load is a share of that.

For each refusal mode a fresh server is started; for each load, each client in turn
(`../shared/tools/loadgen.py`, then `fastload.py`) warms it up for ``--warmup-seconds`` and
then sends single rows, open-loop Poisson, for ``--seconds``. Latencies are the client's,
from each request's scheduled send time. Each row is judged: at most 0.1% of the requests
sent answered after the limit (`LATE_SHARE`), and, refusing at arrival, goodput (answers
within the limit a second) beside that of `oldest` on the same load and client.

With the defaults it takes about 4 minutes; run it under the bench lock on a shared machine
(``flock /tmp/batchserve-bench.lock python -m benchmarks.steady_live``).
``--seconds 2 --warmup-seconds 0.5`` is a smoke run of a few seconds a row.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from batchserve.api.bench.scrape import fetch
from batchserve.runner.core.config import Refuse
from benchmarks.live_clients import RunResult, SharedClient, add_run_options
from benchmarks.live_table import replace_block
from benchmarks.overload import fixture_server
from benchmarks.tight_live import Server, percent, reasons, server_window

MODEL = "steady"
INTERCEPT_S, PER_ROW_S = 0.003, 0.0008
MAX_BATCH = 32
DOC_START = "<!-- steady-live: start -->"
DOC_END = "<!-- steady-live: end -->"
LIMIT_MS = 50.0
CAPACITY_RPS = MAX_BATCH / (INTERCEPT_S + PER_ROW_S * MAX_BATCH)
LOADS = (0.8, 1.5)
MODES: tuple[Refuse, ...] = ("at_arrival", "oldest")
CLIENTS = ("loadgen", "fastload")
LATE_SHARE = 0.001


def config(mode: Refuse, api_workers: int = 2) -> str:
    """One runner of `steady_rows`, refusing in ``mode``."""
    return f"""
api: {{workers: {api_workers}}}
runners:
  {MODEL}:
    model: fixture_models:steady_rows
    batching: {{max_batch_size: {MAX_BATCH}, max_latency_ms: {LIMIT_MS:g}, refuse: {mode}}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 256]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 1]}}]
"""


@dataclass(frozen=True)
class Run:
    """One client's measured run at one load against the server of one mode."""

    mode: Refuse
    load: float
    result: RunResult
    server: Server

    def share(self, count: int) -> float | None:
        return self.result.share(count)

    @property
    def late(self) -> float | None:
        return self.result.late

    @property
    def goodput(self) -> float:
        return self.result.good / self.result.seconds

    def row(self, oldest: Run | None) -> str:
        r, late = self.result, self.late
        ratio = (f"{self.goodput / oldest.goodput:.3f}"
                 if oldest is not None and oldest.goodput > 0 else "-")
        verdict = "PASS" if late is not None and late <= LATE_SHARE else "MISS"
        at_server = self.server.late
        cells = [self.mode, f"{self.load:g}x", r.client, f"{r.sent:,}",
                 percent(self.share(r.good)), f"{100 * late:.2f}" if late is not None else "-",
                 "-" if at_server is None or not r.sent else f"{100 * at_server / r.sent:.2f}",
                 percent(self.share(r.refused)), percent(self.share(r.other)),
                 "-" if r.send_lag_p99_ms is None else f"{r.send_lag_p99_ms:.1f}",
                 f"{self.goodput:.1f}", ratio, verdict, reasons(self.server.unavailable)]
        return "| " + " | ".join(cells) + " |"


HEAD = (f"| mode | load | client | sent | ≤ {LIMIT_MS:g} ms % | late % | late at the server % "
        "| 503 % | other % | client send lag p99 ms | goodput req/s | of oldest's | late ≤ 0.1% "
        "| server's 503s |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")


def table(runs: Sequence[Run]) -> str:
    def oldest(run: Run) -> Run | None:
        return next((o for o in runs if o.mode == "oldest" and o.load == run.load
                     and o.result.client == run.result.client), None)
    return "\n".join([HEAD, *(run.row(oldest(run)) for run in runs)])


def measure(client: SharedClient, base: str, mode: Refuse, load: float,
            args: argparse.Namespace) -> Run:
    url = f"{base}/v2/models/{MODEL}/infer"
    rate = load * CAPACITY_RPS
    if args.warmup_seconds > 0:
        client.run(url, rate, args.warmup_seconds, seed=999)
    before = fetch(base)
    result = client.run(url, rate, args.seconds, seed=1)
    return Run(mode, load, result, server_window(before, fetch(base), MODEL, LIMIT_MS / 1000))


def run(args: argparse.Namespace) -> list[Run]:
    clients = [SharedClient(args.shared_tools / f"{name}.py", args.shared_python,
                            name=name, slo_ms=LIMIT_MS) for name in CLIENTS]
    runs = []
    for mode in MODES:
        with fixture_server(args, config(mode, args.api_workers), args.api_workers,
                            f"batchserve-steady-{mode}-") as (base, _):
            for load in args.loads:
                for client in clients:
                    runs.append(measure(client, base, mode, load, args))
                    print(f"  {runs[-1].row(None)}", file=sys.stderr, flush=True)
    return runs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="of each measured run")
    p.add_argument("--loads", type=lambda text: tuple(float(x) for x in text.split(",")),
                   default=LOADS, help="shares of the capacity, comma-separated")
    add_run_options(p, DOC_START, DOC_END)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:
        runs = run(args)
    except RuntimeError as exc:
        print(f"steady_live: {exc}", file=sys.stderr)
        return 1
    text = (f"single rows for {args.seconds:g} s a run, limit {LIMIT_MS:g} ms, capacity "
            f"{CAPACITY_RPS:.0f} req/s; shares of requests sent.\n\n{table(runs)}")
    print(text)
    if args.doc:
        replace_block(args.doc, text, DOC_START, DOC_END)
    print(f"\ntook {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_bytes(orjson.dumps(
            [{"mode": r.mode, "load": r.load, "late": r.late, "goodput": r.goodput,
              "result": r.result.as_dict()} for r in runs], option=orjson.OPT_INDENT_2))
    missed = [run for run in runs if run.late is None or run.late > LATE_SHARE]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
