"""batchserve's pipeline `classify` beside the same chain called by the client and as a mosec
pipeline, open-loop, each server's whole process tree measured.

    python -m benchmarks.pipeline_peers --doc docs/benchmarks.md

Every window it measures goes to ``--json`` as soon as it is done, and a window already there
is not measured again: when the run stops at ``--budget-s`` (so that it holds the bench lock
for minutes, not an hour), the same command goes on where it stopped. With nothing left to
measure it writes the tables into ``--doc`` between the markers.

The windows, each on a freshly started server after a warm-up:

1. at the low rate, batchserve: the pipeline, then `tokenize` alone, then `text` alone;
2. mosec's sweep: each (max_batch_size, max_wait_time) at the sweep rates;
3. at each rate: the pipeline, the client's two calls, mosec at its best setting of the sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import yaml

from batchserve.api.bench.cpu import cpu_between, server_cpu
from batchserve.api.bench.loadgen import loop_factory, run_load
from batchserve.api.bench.scrape import fetch
from benchmarks.live_table import replace_block
from benchmarks.peers.peer import ROOT
from benchmarks.pipeline_peers import report, servers, table
from benchmarks.pipeline_peers.chain_client import run_chain

START = "<!-- pipeline peers: start -->"
END = "<!-- pipeline peers: end -->"
HEADERS = {"Content-Type": "application/json"}
BATCH_SIZES = (8, 32, 64)
WAITS_MS = (2, 10)


def limit_ms() -> float:
    config = yaml.safe_load((ROOT / "configuration.yml").read_text())
    return float(config["pipelines"]["classify"]["max_latency_ms"])


@dataclass(frozen=True)
class Job:
    """One fresh server and the windows measured on it, by their keys in the JSON file."""

    key: str
    kind: Callable[[], servers.Kind]
    windows: tuple[tuple[str, float], ...]  # (what is sent, rate)
    extra: tuple[tuple[str, Any], ...] = ()


def jobs(args: argparse.Namespace, best: tuple[int, int] | None) -> list[Job]:
    low = args.low_rate
    out = [Job(f"low {low:g}", servers.batchserve,
               (("pipeline", low), ("tokenize", low), ("text", low)))]
    for batch in BATCH_SIZES:
        for wait in WAITS_MS:
            out.append(Job(f"sweep {batch} {wait}", _mosec(batch, wait),
                           tuple(("sweep", rate) for rate in args.sweep_rates),
                           (("max_batch_size", batch), ("max_wait_ms", wait))))
    for rate in args.rates:
        if rate != low:  # measured at the low rate with its steps
            out.append(Job(f"pipeline {rate:g}", servers.batchserve, (("pipeline", rate),)))
        out.append(Job(f"client {rate:g}", servers.batchserve, (("client", rate),)))
        if best is not None:
            out.append(Job(f"mosec {rate:g}", _mosec(*best), (("mosec", rate),),
                           (("max_batch_size", best[0]), ("max_wait_ms", best[1]))))
    return out


def _mosec(batch: int, wait: int) -> Callable[[], servers.Kind]:
    return lambda: servers.mosec(batch, wait)


class Measure:
    """Runs the windows of a job on its server, with the same client settings for all."""

    def __init__(self, runner: asyncio.Runner, args: argparse.Namespace, limit: float) -> None:
        self.runner, self.args, self.limit = runner, args, limit
        self.ids, self.expected = servers.reference()

    def job(self, job: Job) -> list[dict[str, Any]]:
        kind = job.kind()
        log = self.args.logs / f"{job.key.replace(' ', '-')}.log"
        records = []
        with servers.started(kind, self.expected, log) as server:
            if kind.name == "batchserve":
                servers.ask_steps(server.base, self.ids, self.expected)
            for what, rate in job.windows:
                warm = min(rate, self.args.warmup_rate)
                self.window(server, what, warm, self.args.warmup_seconds, seed=1000)
                seconds = self.args.sweep_seconds if what == "sweep" else self.args.seconds
                record = self.window(server, what, rate, seconds, seed=0)
                records.append({**record, **dict(job.extra), "job": job.key})
                print(report.line(record, self.limit), flush=True)
        return records

    def window(self, server: servers.Running, what: str, rate: float, seconds: float,
               seed: int) -> dict[str, Any]:
        """One open-loop window of ``what`` at ``rate``; the server's CPU and counts around it."""
        bs = server.kind.name == "batchserve"
        before_cpu, before = server_cpu(server.pid), fetch(server.base)
        load, first_ok = self.load(server, what, rate, seconds, seed)
        after, after_cpu = fetch(server.base), server_cpu(server.pid)
        rows0, batches0 = server.kind.step1(before)
        rows1, batches1 = server.kind.step1(after)
        cpu = cpu_between(before_cpu, after_cpu)
        step1 = what in ("pipeline", "client", "mosec", "sweep")
        return {
            "server": "mosec" if what == "sweep" else what, "rate": rate,
            "seconds": seconds, "load": load.as_dict(), "cpu_s": cpu.seconds,
            "processes": cpu.processes, "exited": cpu.exited,
            "step1_rows": rows1 - rows0 if step1 else None,
            "step1_batches": batches1 - batches0 if step1 else None,
            "first_ok": first_ok,
            "wasted_counter": (servers.wasted_counter(after) - servers.wasted_counter(before)
                               if bs and what == "pipeline" else None),
            "runner_refusals": servers.runner_refusals(before, after) if bs else None,
        }

    def load(self, server: servers.Running, what: str, rate: float, seconds: float, seed: int
             ) -> tuple[Any, int | None]:
        limit, drain = self.limit, self.args.drain_s
        if what == "client":
            urls = (f"{server.base}/v2/models/tokenize/infer",
                    f"{server.base}/v2/models/text/infer")
            result = self.runner.run(run_chain(urls, servers.v2_text(), servers.follow, rate,
                                               seconds, seed, slo_ms=limit,
                                               drain_timeout=drain))
            return result.load, result.first_ok
        url, body = server.url, server.kind.body
        if what == "tokenize":
            url = f"{server.base}/v2/models/tokenize/infer"
        elif what == "text":
            url, body = f"{server.base}/v2/models/text/infer", servers.v2_tokens(self.ids)
        load = self.runner.run(run_load(url, body, HEADERS, rate, seconds, seed=seed,
                                        slo_ms=limit, drain_timeout=drain))
        return load, None


def options(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_peers",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    rates = lambda text: [float(x) for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--rates", type=rates, default=[50.0, 500.0, 1200.0, 2000.0, 3000.0])
    parser.add_argument("--low-rate", type=float, default=50.0)
    parser.add_argument("--sweep-rates", type=rates, default=[1200.0, 2000.0])
    parser.add_argument("--sweep-seconds", type=float, default=5.0)
    parser.add_argument("--knee", type=float, default=1500.0,
                        help="where the pipeline's goodput stops following the offered rate "
                        "on this machine (a run with --only pipeline finds it)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-rate", type=float, default=200.0)
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument("--drain-s", type=float, default=5.0)
    parser.add_argument("--budget-s", type=float, default=900.0,
                        help="start no new server past this many seconds; run again to go on")
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "pipeline_peers.json")
    parser.add_argument("--fresh", action="store_true", help="forget what --json holds")
    parser.add_argument("--doc", type=Path, default=None,
                        help="write the tables there between the markers when all is measured")
    parser.add_argument("--only", type=lambda t: tuple(t.split(",")), default=(),
                        help="measure only the servers whose keys start so (low, sweep, "
                        "pipeline, client, mosec), e.g. to look for the knee")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/pipeline-peers-logs"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = options(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"records": [], "done": [], "began": None, "minutes": 0.0}
    if args.json.exists() and not args.fresh:
        state = orjson.loads(args.json.read_bytes())
    state["began"] = state["began"] or datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    limit = limit_ms()
    began = time.monotonic()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        measure = Measure(runner, args, limit)
        while True:
            sweep = [r for r in state["records"] if r["job"].startswith("sweep")]
            todo = [j for j in jobs(args, table.best_setting(sweep)) if j.key not in state["done"]]
            sweeping = any(j.key.startswith("sweep") for j in todo)
            todo = [j for j in todo if not (sweeping and j.key.startswith("mosec"))
                    and (not args.only or j.key.startswith(args.only))]
            if not todo:
                break
            if time.monotonic() - began > args.budget_s:
                print(f"{len(todo)} servers left to measure: run the same command again",
                      flush=True)
                return 3
            job = todo[0]
            print(f"{job.key}:", flush=True)
            job_began = time.monotonic()
            state["records"] = [r for r in state["records"] if r["job"] != job.key]
            state["records"] += measure.job(job)
            state["done"].append(job.key)
            state["minutes"] += (time.monotonic() - job_began) / 60
            args.json.write_bytes(orjson.dumps(state, option=orjson.OPT_INDENT_2))
    text = report.markdown(state, args, limit)
    print(text)
    if args.doc is not None:
        replace_block(args.doc, text, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
