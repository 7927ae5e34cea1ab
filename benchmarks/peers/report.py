"""What the sweep found, per server: pure functions from runs to figures, text and a plot.

A rate *passes* on a server when, in every round, the p99 of its OK answers is at most 100 ms
and fewer than 1% of the requests sent got no OK answer. The server's *best rate* is the
highest passing rate of the sweep; goodput (OK answers within 100 ms, per second) is then read
at 1.5 and 2 times that rate.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers.sweep import PASS_NON_OK, Idle, Run

OVERLOADS = (1.5, 2.0)


@dataclass(frozen=True)
class Summary:
    server: str
    best_rate: float | None
    kept_up_rate: float | None  # highest rate with < 1% non-OK in every round, any latency
    p50_at_100_ms: float | None
    goodput: dict[float, float | None]  # offered rate (1.5x, 2x best) -> mean goodput
    cpu_ms_per_req: dict[float, float | None]  # at 100 and 1,600 req/s
    peak_goodput: float
    rounds: int


def at(runs: Sequence[Run], server: str, rate: float) -> list[Run]:
    return [r for r in runs if r.server == server and r.rate == rate]


def mean(runs: Sequence[Run], value: Callable[[Run], float | None]) -> float | None:
    values = [v for r in runs if (v := value(r)) is not None]
    return statistics.fmean(values) if values else None


def best_rate(runs: Sequence[Run], server: str, grid: Sequence[float]) -> float | None:
    """The highest rate of ``grid`` that passed in every round it ran (None when none did)."""
    passing = [rate for rate in grid if (r := at(runs, server, rate)) and all(x.passed for x in r)]
    return max(passing, default=None)


def kept_up_rate(runs: Sequence[Run], server: str, grid: Sequence[float]) -> float | None:
    """The highest rate of ``grid`` answered OK to all but 1% in every round, however late."""
    def kept(r: Run) -> bool:
        return r.load.errors < PASS_NON_OK

    rates = [rate for rate in grid if (r := at(runs, server, rate)) and all(map(kept, r))]
    return max(rates, default=None)


def overload_rates(best: float | None) -> list[float]:
    return [] if best is None else [round(best * k) for k in OVERLOADS]


def summarize(runs: Sequence[Run], server: str, grid: Sequence[float]) -> Summary:
    best = best_rate(runs, server, grid)
    mine = [r for r in runs if r.server == server]
    return Summary(
        server=server,
        best_rate=best,
        kept_up_rate=kept_up_rate(runs, server, grid),
        p50_at_100_ms=mean(at(runs, server, 100.0), lambda r: r.load.ok_p50_ms),
        goodput={rate: mean(at(runs, server, rate), lambda r: r.load.goodput)
                 for rate in overload_rates(best)},
        cpu_ms_per_req={rate: mean(at(runs, server, rate), lambda r: r.cpu_ms_per_req)
                        for rate in (100.0, 1600.0)},
        peak_goodput=max((r.load.goodput for r in mine), default=0.0),
        rounds=len({r.round for r in mine}),
    )


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(mine: float | None, ours: float | None) -> str:
    return "-" if mine is None or not ours else f"{mine / ours:.2f}"


def table(summaries: Sequence[Summary], model_limit: float) -> str:
    """The headline table; ratios are against batchserve's row, shares against the model."""
    ours = next((s for s in summaries if s.server == "batchserve"), None)
    head = (
        "| server | best rate req/s | < 1% non-OK up to req/s | p50 at 100 req/s ms "
        "| goodput at 1.5x req/s "
        "| goodput at 2x req/s | CPU ms/req at 100 | CPU ms/req at 1,600 | peak goodput req/s "
        "| peak / model limit | best rate / batchserve's | goodput 1.5x / batchserve's "
        "| goodput 2x / batchserve's |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for s in summaries:
        puts = [f"{_n(v)} (of {rate:g})" for rate, v in s.goodput.items()] or ["-", "-"]
        mine = list(s.goodput.values()) or [None, None]
        theirs = list(ours.goodput.values()) if ours and ours.goodput else [None, None]
        lines.append(
            f"| {s.server} | {_n(s.best_rate)} | {_n(s.kept_up_rate)} "
            f"| {_n(s.p50_at_100_ms, 1)} | {puts[0]} "
            f"| {puts[1]} | {_n(s.cpu_ms_per_req[100.0], 2)} "
            f"| {_n(s.cpu_ms_per_req[1600.0], 2)} | {_n(s.peak_goodput)} "
            f"| {100 * s.peak_goodput / model_limit:.0f}% "
            f"| {_ratio(s.best_rate, ours.best_rate if ours else None)} "
            f"| {_ratio(mine[0], theirs[0])} | {_ratio(mine[1], theirs[1])} |"
        )
    return "\n".join(lines)


def runs_table(runs: Sequence[Run]) -> str:
    """Every run: server, round, rate, and what the client and the server's CPU said."""
    lines = [
        "| server | round | rate | sent | non-OK % | p50 ms | p99 ms | goodput req/s "
        "| CPU ms/req | pass |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(runs, key=lambda r: (r.server, r.rate, r.round)):
        load = r.load
        lines.append(
            f"| {r.server} | {r.round + 1} | {r.rate:g} | {load.sent} | {100 * load.errors:.2f} "
            f"| {_n(load.ok_p50_ms, 1)} | {_n(load.ok_p99_ms, 1)} | {load.goodput:.0f} "
            f"| {r.cpu_ms_per_req:.2f} | {'yes' if r.passed else 'no'} |"
        )
    return "\n".join(lines)


def model_table(limit: Mapping[int, float]) -> str:
    cells = " | ".join(f"{rate:,.0f}" for rate in limit.values())
    return (f"| batch size | {' | '.join(str(b) for b in limit)} |\n"
            f"|---|{'---:|' * len(limit)}\n| samples/s | {cells} |")


def plot(runs: Sequence[Run], model_limit: float, path: Path) -> None:
    """p99 and goodput against the offered rate, one line per server (mean over rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, put) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    axes: Any = (lat, put)
    for server in dict.fromkeys(r.server for r in runs):
        rates = sorted({r.rate for r in runs if r.server == server})
        p99 = [mean(at(runs, server, x), lambda r: r.load.ok_p99_ms) for x in rates]
        good = [mean(at(runs, server, x), lambda r: r.load.goodput) for x in rates]
        lat.plot(rates, [float("nan") if v is None else v for v in p99], "o-", label=server)
        put.plot(rates, good, "o-", label=server)
    lat.axhline(100, color="grey", linestyle="--", label="100 ms")
    lat.set(xlabel="offered req/s (Poisson)", ylabel="p99 of OK answers, ms", yscale="log",
            title="latency")
    top = max((r.rate for r in runs), default=1.0)
    put.plot([0, top], [0, top], ":", color="grey", label="offered")
    put.set(xlabel="offered req/s (Poisson)", ylabel="OK within 100 ms, req/s",
            title=f"goodput (the model alone, offline: {model_limit:,.0f} samples/s)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle("bundled MLP 256-1024-1024-16, batches up to 64, 2 shared cores")
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def per_round(values: Sequence[float | None], digits: int, unit: str = "") -> str:
    """``a / b``: one figure per round, in the order the rounds ran."""
    return " / ".join(_n(v, digits) + unit if v is not None else "-" for v in values) or "-"


def cost_table(runs: Sequence[Run], idles: Sequence[Idle], grid: Sequence[float],
               rounds: int) -> str:
    """What each server costs, round by round (each cell gives every round's own figure):
    CPU per request at 1,600 and 2,400 req/s, idle CPU, the highest rate passed, p50 at 100."""
    servers = list(dict.fromkeys(r.server for r in runs))

    def cells(value: Callable[[str, int], float | None], digits: int, unit: str = "") -> str:
        return " | ".join(per_round([value(s, k) for k in range(rounds)], digits, unit)
                          for s in servers)

    def run(server: str, round_: int, rate: float) -> Run | None:
        return next((r for r in runs if (r.server, r.round, r.rate) == (server, round_, rate)),
                    None)

    def cpu(rate: float) -> Callable[[str, int], float | None]:
        return lambda s, k: (r.cpu_ms_per_req if (r := run(s, k, rate)) else None)

    def best(server: str, round_: int) -> float | None:
        passed = [rate for rate in grid if (r := run(server, round_, rate)) and r.passed]
        return max(passed, default=None)

    def idle_pct(server: str, round_: int) -> float | None:
        return next((100 * i.share for i in idles if (i.server, i.round) == (server, round_)),
                    None)

    def p50(server: str, round_: int) -> float | None:
        return r.load.ok_p50_ms if (r := run(server, round_, 100.0)) else None

    lines = ["| per round | " + " | ".join(servers) + " |",
             "|---|" + "---:|" * len(servers)]
    for rate in (r for r in grid if r in (1600.0, 2400.0)):
        lines.append(f"| server CPU ms per request at {rate:,.0f} req/s | {cells(cpu(rate), 2)} |")
    lines.append(f"| idle, no traffic (share of one core) | {cells(idle_pct, 2, '%')} |")
    lines.append(f"| highest rate passed (tried {', '.join(f'{g:,.0f}' for g in grid)}) "
                 f"| {cells(best, 0)} |")
    lines.append(f"| p50 at 100 req/s, ms | {cells(p50, 1)} |")
    return "\n".join(lines)


def overload_table(runs: Sequence[Run], rate: float) -> str:
    """Each server at one overload rate, every round: goodput, how fast its refusals came
    against the client's own lag, whether anything was lost, how soon it recovered."""
    lines = ["| server | round | offered req/s | goodput req/s | 503s | 503 p99 ms "
             "| client send lag p99 ms | no answer | not sent: client's connections all busy "
             "| lone request OK again after s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted((r for r in runs if r.rate == rate), key=lambda r: (r.server, r.round)):
        load = r.load
        backlog = load.status_counts.get("client_backlog", 0)
        lost = load.sent - load.answered - backlog
        lines.append(
            f"| {r.server} | {r.round + 1} | {rate:,.0f} | {load.goodput:,.0f} "
            f"| {load.status_counts.get('503', 0):,} | {_n(load.refused_p99_ms, 1)} "
            f"| {_n(load.timer_lag_p99_ms, 1)} | {lost:,} | {backlog:,} "
            f"| {_n(r.recovery_s, 2)} |")
    return "\n".join(lines)
