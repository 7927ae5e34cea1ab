"""The live table: the real server under two independent open-loop clients.

For each client (batchserve's own generator, then the shared aiohttp one) and each rate, a
fresh server is started, warmed up, and driven for ``--runs`` runs of ``--seconds`` each;
then, on another fresh server, the overload sequence: ``--overload-rate`` for
``--overload-seconds``, then ``--recovery-rate`` starting ``--gap`` s after the overload
stops sending. Around every run ``/metrics`` and the server's process-tree CPU are read, so
each run's row also says how the latency model's predictions held (p99 of observed over
predicted batch time), the mean batch size, and the server's CPU per request.

    python -m benchmarks.live_table [--rates 100,400,800,1600,2400] [--seconds 10] [--json F]

``--busy N`` runs it all beside N CPU-bound processes (`benchmarks.busy`): a busy machine.

Run it from the repository root; on a shared machine under the bench lock
(``flock /tmp/batchserve-bench.lock python -m benchmarks.live_table``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import orjson

from batchserve.api.bench.cpu import cpu_between, tree_cpu
from batchserve.api.bench.loadgen import loop_factory
from batchserve.api.bench.scrape import Scrape, bucket_delta, delta, fetch, histogram_quantile
from batchserve.api.bench.server import serve
from benchmarks.busy import beside, busy
from benchmarks.live_clients import Client, OwnClient, RunResult, SharedClient
from benchmarks.live_report import Row, Window, markdown, overload_markdown, summary

ROOT = Path(__file__).resolve().parent.parent
MODEL = "mlp"
README_START = "<!-- live-table: start -->"
README_END = "<!-- live-table: end -->"


def window(before: Scrape, after: Scrape, cpu_s: float, sent: int) -> Window:
    """What the server recorded between two readings of ``/metrics``."""
    ratio = "batchserve_batch_time_ratio"
    ratios = bucket_delta(before.buckets(ratio, runner=MODEL), after.buckets(ratio, runner=MODEL))

    def grew(name: str) -> float:
        return after.total(name, runner=MODEL) - before.total(name, runner=MODEL)

    rows = grew("batchserve_adaptive_batch_size_sum")
    batches = grew("batchserve_adaptive_batch_size_count")
    model_cpu_s = grew("batchserve_batch_cpu_seconds_sum")
    codes = "batchserve_requests_total"
    rejected = "batchserve_rejections_total"
    return Window(
        ratio_p99=histogram_quantile(0.99, ratios) if ratios else None,
        batches=int(batches),
        mean_batch=rows / batches if batches else None,
        cpu_ms_per_req=cpu_s * 1e3 / sent if sent else None,
        codes=delta(before.by_label(codes, "code", runner=MODEL),
                    after.by_label(codes, "code", runner=MODEL)),
        rejections=delta(before.by_label(rejected, "reason", runner=MODEL),
                         after.by_label(rejected, "reason", runner=MODEL)),
        model_cpu_ms_per_req=model_cpu_s * 1e3 / sent if sent else None,
    )


T = tuple[RunResult, ...]


def observed(base: str, root: int, act: Callable[[], T]) -> tuple[T, Window]:
    """Run ``act`` between two readings of ``/metrics`` and of the server's CPU."""
    before, cpu0 = fetch(base), tree_cpu(root)
    results = act()
    cpu1, after = tree_cpu(root), fetch(base)
    sent = sum(r.sent for r in results)
    return results, window(before, after, cpu_between(cpu0, cpu1).seconds, sent)


@contextlib.contextmanager
def fresh_server(args: argparse.Namespace, what: str) -> Iterator[tuple[str, int]]:
    """A newly started server for ``what``; its log is kept in ``args.logs``."""
    log = args.logs / f"server-{what}.log"
    with serve(args, log, cwd=ROOT) as (base, root):
        yield base, root


def rate_rows(client: Client, args: argparse.Namespace, rate: float) -> list[Row]:
    with fresh_server(args, f"{client.name}-{rate:g}") as (base, root):
        url = f"{base}/v2/models/{MODEL}/infer"
        client.run(url, args.warmup_rate, args.warmup_seconds, seed=999)
        rows = []
        for run in range(1, args.runs + 1):
            seed = int(rate) * 10 + run

            def act(seed: int = seed) -> T:
                return (client.run(url, rate, args.seconds, seed),)

            (result,), win = observed(base, root, act)
            rows.append(Row(run, result, win))
            print(f"  {client.name} {rate:g} req/s run {run}: {markdown([rows[-1]], head=False)}",
                  file=sys.stderr, flush=True)
    return rows


def overload_rows(client: Client, args: argparse.Namespace) -> dict[str, object]:
    with fresh_server(args, f"{client.name}-overload") as (base, root):
        url = f"{base}/v2/models/{MODEL}/infer"
        client.run(url, args.warmup_rate, args.warmup_seconds, seed=999)
        high = (args.overload_rate, args.overload_seconds)
        low = (args.recovery_rate, args.recovery_seconds)
        startup: list[float] = []

        def act() -> T:
            over, after, lag = client.overload(url, high, low, args.gap, seed=7)
            startup.append(lag)
            return over, after

        (over, after), win = observed(base, root, act)
    return {"client": client.name, "overload": over, "recovery": after, "gap_s": args.gap,
            "recovery_startup_s": startup[0], "server": win}


def clients(args: argparse.Namespace, runner: asyncio.Runner) -> list[Client]:
    table: dict[str, Callable[[], Client]] = {
        "batchserve": lambda: OwnClient(runner),
        "shared": lambda: SharedClient(args.shared_loadgen, args.shared_python),
    }
    return [table[name]() for name in args.clients.split(",")]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configuration.yml")
    p.add_argument("--api-workers", type=int, default=2)
    p.add_argument("--clients", default="batchserve,shared", help="batchserve, shared or both")
    p.add_argument("--rates", default="100,400,800,1600,2400", help="comma-separated req/s")
    p.add_argument("--runs", type=int, default=3, help="runs at each rate")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each run")
    p.add_argument("--warmup-rate", type=float, default=200.0)
    p.add_argument("--warmup-seconds", type=float, default=3.0)
    p.add_argument("--overload-rate", type=float, default=3200.0)
    p.add_argument("--overload-seconds", type=float, help="default: --seconds")
    p.add_argument("--recovery-rate", type=float, default=200.0)
    p.add_argument("--recovery-seconds", type=float, help="default: --seconds")
    p.add_argument("--gap", type=float, default=1.0, help="s from overload's end to recovery")
    p.add_argument("--no-overload", action="store_true", help="skip the overload sequence")
    p.add_argument("--shared-loadgen", type=Path, default=ROOT.parent / "shared/tools/loadgen.py")
    p.add_argument("--shared-python", default=sys.executable, help="interpreter for it")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--busy", type=int, default=0, help="CPU-bound processes to run beside")
    p.add_argument("--json", type=Path, help="write every figure to this file")
    p.add_argument("--doc", "--readme", dest="doc", type=Path,
                   help="also put the tables into this file (docs/performance.md), between "
                   f"the lines {README_START!r} and {README_END!r}")
    args = p.parse_args(argv)
    args.port = 0  # batchserve.api.bench.server.serve picks a free port
    args.overload_seconds = args.overload_seconds or args.seconds
    args.recovery_seconds = args.recovery_seconds or args.seconds
    args.logs = Path(tempfile.mkdtemp(prefix=f"batchserve-live-{os.getpid()}-"))
    return args


def run(args: argparse.Namespace) -> dict[str, object]:
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    report: dict[str, object] = {"server_logs": str(args.logs), "rows": {}, "overload": [],
                                 "busy": args.busy}
    with busy(args.busy), asyncio.Runner(loop_factory=loop_factory()) as runner:
        for client in clients(args, runner):
            rows = [row for rate in rates for row in rate_rows(client, args, rate)]
            report["rows"][client.name] = rows  # type: ignore[index]
            if not args.no_overload:
                report["overload"].append(overload_rows(client, args))  # type: ignore[attr-defined]
    return report


def as_json(report: dict[str, object]) -> bytes:
    def default(value: object) -> object:
        if hasattr(value, "as_dict"):
            return value.as_dict()
        raise TypeError(type(value).__name__)

    return orjson.dumps(report, default=default, option=orjson.OPT_INDENT_2)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except RuntimeError as exc:
        print(f"live_table: {exc}", file=sys.stderr)
        return 1
    rows: dict[str, list[Row]] = report["rows"]  # type: ignore[assignment]
    tables = [markdown([row for client_rows in rows.values() for row in client_rows]),
              summary(rows)]
    if report["overload"]:
        tables.append(overload_markdown(report["overload"]))  # type: ignore[arg-type]
    if args.busy:
        tables.insert(0, f"Measured{beside(args.busy)}.")
    text = "\n\n".join(tables)
    print(text)
    print(f"\nserver logs: {args.logs}")
    if args.json:
        args.json.write_bytes(as_json(report))
    if args.doc:
        replace_block(args.doc, text)
    return 0


def replace_block(path: Path, text: str, first: str = README_START,
                  last: str = README_END) -> None:
    """Put ``text`` between the lines ``first`` and ``last`` of ``path``."""
    content = path.read_text()
    start, end = content.find(first), content.find(last)
    if start < 0 or end < start:
        raise SystemExit(f"{path} has no {first!r} ... {last!r} block")
    head = content[: start + len(first)]
    path.write_text(f"{head}\n{text}\n{content[end:]}")


if __name__ == "__main__":
    sys.exit(main())
