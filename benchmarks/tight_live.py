"""The live tight-limit check: the simulator's `tight_12ms` on the real server, in both
refusal modes, under both load clients.

    python -m benchmarks.tight_live [--rounds 2] [--seconds 20] [--doc docs/dispatcher-results.md]

The model (`paced_rows` in `tests/fixture_models.py`) takes 5 ms plus 0.5 ms a row per
batch, spent sleeping, as `benchmarks/scenarios/tight_12ms.yml` says; one runner of it serves
with `max_latency_ms: 12` and `max_batch_size: 64`, behind two API workers. For each refusal
mode (`refuse: at_arrival`, then `refuse: oldest`) a fresh server is started, and each client
in turn (this project's generator, then `../shared/tools/loadgen.py`) warms it up for
``--warmup-seconds`` and then sends single rows at 300 req/s, open-loop Poisson, for
``--seconds``. ``--rounds`` repeats that with the order of modes and clients reversed every
other round, so neither mode always runs first; within a round both modes get the same
arrival schedule.

Per mode, client and round it reports the requests sent; the shares answered 200 within the
limit, 200 late, 503, and otherwise; the p99 of the 503s, the p50 and p99 of the 200s, the
client's send lag p99, the server's mean batch and its answers other than 200: 503s by
reason (`batchserve_unavailable_total`), other statuses (`batchserve_requests_total`), read
from `/metrics` around the measured run. Every latency is the client's, from the request's
**scheduled** send time. ``--json`` also keeps the runner's latency model and batch cap at the
end of each run, and what one row costs the idle model by it (past the limit, the runner
answers every request 413).

The clients share the machine's two cores with the server. A client that sends late (its
timer woke late, its event loop was busy) adds that lag to every latency it reports, and at a
12 ms limit a few milliseconds of lag is a large part of the budget: the share within the
limit is what a client on this machine sees, a lower bound on what the server did, and the
send lag column says how much of the budget the client itself took. The model sleeps, so what
the client's CPU takes from the server is the front's and the dispatcher's time, not the
model's.

About 3½ minutes with the defaults. Run it from the repository root, under the bench lock on a
shared machine (``flock /tmp/batchserve-bench.lock python -m benchmarks.tight_live``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import orjson

from batchserve.api.bench.loadgen import loop_factory
from batchserve.api.bench.scrape import Scrape, bucket_delta, delta, fetch
from batchserve.runner.core.config import Refuse
from batchserve.runner.policy.latency_model import Fit
from benchmarks.live_clients import Client, OwnClient, RunResult, SharedClient, add_run_options
from benchmarks.live_report import num
from benchmarks.live_table import replace_block
from benchmarks.overload import fixture_server

MODEL = "tight"
LIMIT_MS = 12.0
RATE = 300.0
MODES: tuple[Refuse, ...] = ("at_arrival", "oldest")
CLIENTS = ("batchserve", "shared")
DOC_START = "<!-- tight-live: start -->"
DOC_END = "<!-- tight-live: end -->"


def config(mode: Refuse, api_workers: int = 2) -> str:
    """One runner of `paced_rows`, as `tight_12ms` has it, refusing in ``mode``."""
    return f"""
api: {{workers: {api_workers}}}
runners:
  {MODEL}:
    model: fixture_models:paced_rows
    batching: {{max_batch_size: 64, max_latency_ms: {LIMIT_MS:g}, refuse: {mode}}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 256]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 1]}}]
"""


GAUGES = {
    "intercept_s": "batchserve_latency_model_intercept_seconds",
    "slope_s": "batchserve_latency_model_slope_seconds",
    "stretch": "batchserve_latency_model_stretch",
    "cap": "batchserve_dispatcher_batch_cap",
    "window_s": "batchserve_dispatcher_window_seconds",
}
"""The runner's latency model and decisions, read at the end of a run (JSON only)."""


@dataclass(frozen=True)
class Server:
    """What the server counted during one measured run, from two readings of `/metrics`."""

    codes: dict[str, float]  # answers by status
    unavailable: dict[str, float]  # 503s by reason, as the API workers answered them
    rejections: dict[str, float]  # the runner's own refusals by reason
    batches: int
    rows: int
    model: dict[str, float]  # GAUGES at the end of the run
    late: int | None = None  # 200s the API workers answered past the limit, if a bucket ends there

    @property
    def mean_batch(self) -> float | None:
        return self.rows / self.batches if self.batches else None

    @property
    def one_row_ms(self) -> float | None:
        """What one row costs the idle model by its latency model at the end of the run: past
        the limit, the runner answers every request 413."""
        model = self.model
        if not {"intercept_s", "slope_s", "stretch"} <= model.keys():
            return None
        fit = Fit(model["intercept_s"], model["slope_s"], stretch=model["stretch"])
        return fit.cost(1) * 1000

    def non_ok(self) -> str:
        """503s by reason, then any other status than 200, largest first."""
        other = {f"status {code}": n for code, n in self.codes.items()
                 if code not in ("200", "503")}
        return reasons({**self.unavailable, **other})


def server_window(before: Scrape, after: Scrape, runner: str = MODEL,
                  limit_s: float | None = None) -> Server:
    def by(name: str, label: str) -> dict[str, float]:
        return delta(before.by_label(name, label, runner=runner),
                     after.by_label(name, label, runner=runner))

    def grown(name: str) -> int:
        return round(after.total(name, runner=runner) - before.total(name, runner=runner))

    size = "batchserve_adaptive_batch_size"
    model = {key: after.maximum(name, runner=runner) for key, name in GAUGES.items()}
    return Server(codes=by("batchserve_requests_total", "code"),
                  unavailable=by("batchserve_unavailable_total", "reason"),
                  rejections=by("batchserve_rejections_total", "reason"),
                  batches=grown(f"{size}_count"), rows=grown(f"{size}_sum"),
                  model={key: value for key, value in model.items() if value is not None},
                  late=None if limit_s is None else late_at_server(before, after, runner, limit_s))


def late_at_server(before: Scrape, after: Scrape, runner: str, limit_s: float) -> int | None:
    """200s answered more than `limit_s` after their headers were read, by the API workers'
    own clock (None unless a bucket of the duration histogram ends at the limit): the
    lateness a client counts beyond this was spent outside the server's processes."""
    name, labels = "batchserve_request_duration_seconds", {"runner": runner, "code": "200"}
    buckets = bucket_delta(before.buckets(name, **labels), after.buckets(name, **labels))
    if limit_s not in buckets:
        return None
    return round(buckets[math.inf] - buckets[limit_s])


@dataclass(frozen=True)
class Run:
    """One client's measured run against the server of one mode."""

    mode: Refuse
    round: int
    result: RunResult
    server: Server

    def share(self, count: int) -> float | None:
        return self.result.share(count)

    @property
    def within(self) -> float | None:
        """Answered 200 within the limit, from the scheduled send time."""
        return self.share(self.result.good)

    @property
    def late(self) -> float | None:
        return self.result.late

    @property
    def refused(self) -> float | None:
        return self.share(self.result.refused)

    @property
    def other(self) -> float | None:
        return self.share(self.result.other)

    def row(self) -> str:
        r = self.result
        cells = [self.mode, r.client, str(self.round), f"{r.sent:,}", percent(self.within),
                 percent(self.late), percent(self.refused), percent(self.other),
                 num(r.refused_p99_ms, 2), num(r.p50_ms, 2), num(r.p99_ms, 2),
                 num(r.send_lag_p99_ms, 2), num(self.server.mean_batch), self.server.non_ok()]
        return "| " + " | ".join(cells) + " |"

    def as_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "round": self.round, "within": self.within,
                "late": self.late, "refused": self.refused, "other": self.other,
                "result": self.result.as_dict(),
                "server": {**asdict(self.server), "mean_batch": self.server.mean_batch,
                           "one_row_ms": self.server.one_row_ms}}


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.1f}"


def reasons(counts: Mapping[str, float]) -> str:
    """`queue 4,210, front 3`: counts by reason, largest first; `none` when there are none."""
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{reason} {round(n):,}" for reason, n in ordered) or "none"


HEAD = (f"| mode | client | round | sent | ≤ {LIMIT_MS:g} ms % | late % | 503 % | other % | "
        "503 p99 ms | OK p50 ms | OK p99 ms | send lag p99 ms | mean batch | "
        "server's non-200 answers |\n" + "|---" * 3 + "|---:" * 10 + "|---|")


def table(runs: Sequence[Run]) -> str:
    return "\n".join([HEAD, *(run.row() for run in runs)])


def summary(runs: Sequence[Run]) -> str:
    """The share within the limit per mode and client, each round's and their mean."""
    lines = [f"| mode | client | ≤ {LIMIT_MS:g} ms %, each round | mean |", "|---|---|---|---:|"]
    for mode in dict.fromkeys(run.mode for run in runs):
        for client in dict.fromkeys(run.result.client for run in runs):
            shares = [run.within for run in sorted(runs, key=lambda run: run.round)
                      if run.mode == mode and run.result.client == client]
            known = [share for share in shares if share is not None]
            mean = sum(known) / len(known) if known else None
            each = ", ".join(percent(share) for share in shares)
            if shares:
                lines.append(f"| {mode} | {client} | {each} | {percent(mean)} |")
    return "\n".join(lines)


def plan(rounds: int, modes: Sequence[Refuse] = MODES,
         clients: Sequence[str] = CLIENTS) -> list[tuple[int, Refuse, tuple[str, ...]]]:
    """Each server to start, in order: (round, mode, the clients it serves in order). Every
    other round runs the modes and the clients in reverse."""
    servers = []
    for n in range(1, rounds + 1):
        step = 1 if n % 2 else -1
        servers += [(n, mode, tuple(clients[::step])) for mode in modes[::step]]
    return servers


def measure(client: Client, base: str, mode: Refuse, round_: int,
            args: argparse.Namespace) -> Run:
    """Warm the server up with ``client``, then one measured run between two readings of
    `/metrics`. The measured schedule depends on the round only, so both modes get it."""
    url = f"{base}/v2/models/{MODEL}/infer"
    client.run(url, args.rate, args.warmup_seconds, seed=999)
    before = fetch(base)
    result = client.run(url, args.rate, args.seconds, seed=round_)
    return Run(mode, round_, result, server_window(before, fetch(base)))


def run(args: argparse.Namespace, runner: asyncio.Runner) -> list[Run]:
    makers: dict[str, Callable[[], Client]] = {
        "batchserve": lambda: OwnClient(runner, slo_ms=LIMIT_MS),
        "shared": lambda: SharedClient(args.shared_tools / "loadgen.py", args.shared_python,
                                       slo_ms=LIMIT_MS),
    }
    clients = {name: makers[name]() for name in CLIENTS}
    runs = []
    for round_, mode, order in plan(args.rounds):
        prefix = f"batchserve-tight-{mode}-"
        with fixture_server(args, config(mode, args.api_workers), args.api_workers,
                            prefix) as (base, _):
            for name in order:
                runs.append(measure(clients[name], base, mode, round_, args))
                print(f"  {runs[-1].row()}", file=sys.stderr, flush=True)
    return runs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="every mode and client, this often")
    p.add_argument("--seconds", type=float, default=20.0, help="of each measured run")
    p.add_argument("--rate", type=float, default=RATE, help="req/s, single rows")
    add_run_options(p, DOC_START, DOC_END)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runs = run(args, runner)
    except RuntimeError as exc:
        print(f"tight_live: {exc}", file=sys.stderr)
        return 1
    text = "\n\n".join([
        f"{args.rate:g} req/s of single rows for {args.seconds:g} s a run, limit "
        f"{LIMIT_MS:g} ms; shares of requests sent.", table(runs), summary(runs)])
    print(text)
    print(f"\ntook {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_bytes(orjson.dumps([run.as_dict() for run in runs],
                                           option=orjson.OPT_INDENT_2))
    if args.doc:
        replace_block(args.doc, text, DOC_START, DOC_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
