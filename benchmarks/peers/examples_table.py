"""What the example models' side-by-side run concludes, from its runs alone: pure, no I/O.

A run is one server at one batching setting and one rate for one phase: ``sweep`` (a peer at
each setting of a small grid), ``grid`` (each server at its best setting, at every rate) and
``overload`` (each server at twice its own knee). The results file holds the runs of every
invocation, merged, so the phases can be measured apart and rendered together:

- a peer's **best setting** is the one with the most good answers over the sweep's rates
  (ties: the lower p99 at the highest rate, then the smaller batch and the shorter wait);
- a server's **knee** is the highest rate of the grid up to which every rate had at least 99%
  of the requests sent answered OK within the model's limit;
- **goodput** is those good answers per second.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

PHASES = ("sweep", "grid", "overload")
GOOD_SHARE = 0.99
"""The share of requests sent that must be answered OK within the limit for a rate to hold."""


@dataclass(frozen=True)
class Setting:
    """One server with one batching setting (batchserve's is adaptive: none to give)."""

    server: str
    max_batch_size: int = 0
    max_wait_ms: int = 0

    @property
    def label(self) -> str:
        if self.server == "batchserve":
            return "adaptive (examples/models.yml)"
        return f"max_batch_size={self.max_batch_size}, max_wait_ms={self.max_wait_ms}"


@dataclass(frozen=True)
class Run:
    """One server, setting and rate, measured in one phase for one model."""

    model: str
    phase: str
    server: str
    max_batch_size: int
    max_wait_ms: int
    rate: float
    seconds: float
    sent: int
    good: int  # OK answers within the model's limit
    ok: int
    refused: int  # 503 answers
    goodput: float  # good answers per second
    p50_ms: float | None  # of the OK answers
    p99_ms: float | None
    cpu_ms_per_request: float  # the server's whole process tree, over requests sent
    measured: str  # UTC, when

    @property
    def setting(self) -> Setting:
        return Setting(self.server, self.max_batch_size, self.max_wait_ms)

    @property
    def key(self) -> tuple[str, str, Setting, float]:
        return self.model, self.phase, self.setting, self.rate

    @property
    def good_share(self) -> float:
        return self.good / self.sent if self.sent else 0.0

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Run:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})  # type: ignore[arg-type]


def merge(old: Iterable[Run], new: Iterable[Run]) -> list[Run]:
    """``old`` with every run of ``new`` in, a new run replacing an old one of the same key.

    A server's grid and overload runs are of one setting: new ones at another setting (a
    sweep measured again chose another) drop the old ones of that model, phase and server.
    """
    new = list(new)
    moved = {(r.model, r.phase, r.server): r.setting for r in new if r.phase != "sweep"}
    runs = {run.key: run for run in old
            if moved.get((run.model, run.phase, run.server), run.setting) == run.setting}
    runs.update((run.key, run) for run in new)
    return sorted(runs.values(), key=lambda r: (r.model, PHASES.index(r.phase), r.server,
                                                  r.max_batch_size, r.max_wait_ms, r.rate))


def select(runs: Iterable[Run], model: str, phase: str, server: str | None = None
           ) -> list[Run]:
    return [r for r in runs if r.model == model and r.phase == phase
            and (server is None or r.server == server)]


def best_setting(sweep: Sequence[Run]) -> Setting:
    """The setting with the most good answers over the sweep's rates (see the module)."""
    if not sweep:
        raise ValueError("no sweep runs to choose a setting from")
    by_setting: dict[Setting, list[Run]] = {}
    for run in sweep:
        by_setting.setdefault(run.setting, []).append(run)

    def score(item: tuple[Setting, list[Run]]) -> tuple[float, float, int, int]:
        setting, runs = item
        top = max(runs, key=lambda r: r.rate)
        p99 = top.p99_ms if top.p99_ms is not None else float("inf")
        return (-sum(r.good for r in runs), p99, setting.max_batch_size, setting.max_wait_ms)

    return min(by_setting.items(), key=score)[0]


def knee(grid: Sequence[Run]) -> float | None:
    """The highest rate up to which every rate held (see the module); None if the lowest did not."""
    held = None
    for run in sorted(grid, key=lambda r: r.rate):
        if run.good_share < GOOD_SHARE:
            break
        held = run.rate
    return held


@dataclass(frozen=True)
class Verdict:
    """Whether batchserve's goodput is at least each peer's at every rate, and its knee."""

    goodput_short: tuple[str, ...]  # where it is not: "mosec at 40 req/s (38.2 < 39.6)"
    knee_short: tuple[str, ...]  # peers whose knee is above batchserve's
    rates: tuple[float, ...]

    @property
    def holds(self) -> bool:
        return not self.goodput_short and not self.knee_short


def verdict(runs: Sequence[Run], model: str, peers: Sequence[str]) -> Verdict:
    ours = {r.rate: r for r in select(runs, model, "grid", "batchserve")}
    our_knee = knee(list(ours.values()))
    goodput_short: list[str] = []
    knee_short: list[str] = []
    for peer in peers:
        theirs = select(runs, model, "grid", peer)
        for run in sorted(theirs, key=lambda r: r.rate):
            mine = ours.get(run.rate)
            if mine is not None and mine.goodput < run.goodput:
                goodput_short.append(f"{peer} at {_rate(run.rate)} req/s "
                                     f"({mine.goodput:.1f} < {run.goodput:.1f})")
        their_knee = knee(theirs)
        if their_knee is not None and (our_knee is None or our_knee < their_knee):
            knee_short.append(f"{peer} ({_rate(their_knee)} > {_rate(our_knee)})")
    return Verdict(tuple(goodput_short), tuple(knee_short), tuple(sorted(ours)))


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:g}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _percent(part: int, whole: int) -> str:
    return "-" if not whole else f"{100 * part / whole:.1f}"


def summary_table(runs: Sequence[Run], model: str, limit_ms: float,
                  servers: Sequence[str]) -> str:
    """One row per server: its setting, knee, p50 and CPU, and how it does at twice its knee."""
    head = ("| server | setting | knee req/s | p50 at lowest rate ms | CPU ms/req at lowest rate "
            "| CPU ms/req at knee | 2x knee: offered req/s | 2x knee: goodput req/s "
            "| 2x knee: 503 % | 2x knee: OK % | 2x knee: p99 of OK ms |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for server in servers:
        grid = sorted(select(runs, model, "grid", server), key=lambda r: r.rate)
        if not grid:
            continue
        rate = knee(grid)
        at_knee = next((r for r in grid if r.rate == rate), None)
        over = select(runs, model, "overload", server)
        o = max(over, key=lambda r: r.measured) if over else None
        cells = [server, grid[0].setting.label, _rate(rate), _ms(grid[0].p50_ms),
                 f"{grid[0].cpu_ms_per_request:.1f}",
                 "-" if at_knee is None else f"{at_knee.cpu_ms_per_request:.1f}"]
        cells += (["-"] * 5 if o is None else
                  [_rate(o.rate), f"{o.goodput:.1f}", _percent(o.refused, o.sent),
                   _percent(o.ok, o.sent), _ms(o.p99_ms)])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goodput_table(runs: Sequence[Run], model: str, servers: Sequence[str]) -> str:
    """Goodput within the limit, req/s, one column per rate of the grid, one row per server."""
    grid = select(runs, model, "grid")
    rates = sorted({r.rate for r in grid})
    lines = ["| server | " + " | ".join(f"{_rate(r)} req/s" for r in rates) + " |",
             "|---|" + "---:|" * len(rates)]
    for server in servers:
        mine = {r.rate: r for r in grid if r.server == server}
        if mine:
            cells = [_goodput_cell(mine.get(rate)) for rate in rates]
            lines.append(f"| {server} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _goodput_cell(run: Run | None) -> str:
    if run is None:
        return "-"
    return f"{run.goodput:.1f} ({100 * run.good_share:.0f}%)"


def sweep_table(runs: Sequence[Run], model: str, servers: Sequence[str]) -> str:
    """Every setting each peer was swept at: its goodput at each sweep rate, the best marked."""
    sweep = select(runs, model, "sweep")
    rates = sorted({r.rate for r in sweep})
    lines = ["| server | setting | " + " | ".join(
        f"goodput at {_rate(r)} req/s" for r in rates) + " | p99 of OK at the top rate ms |",
        "|---|---|" + "---:|" * (len(rates) + 1)]
    for server in servers:
        mine = [r for r in sweep if r.server == server]
        if not mine:
            continue
        best = best_setting(mine)
        for setting in sorted({r.setting for r in mine},
                              key=lambda s: (s.max_batch_size, s.max_wait_ms)):
            at = {r.rate: r for r in mine if r.setting == setting}
            cells = [_goodput_cell(at.get(rate)) for rate in rates]
            top = at[max(at)]
            name = f"**{setting.label}** (best)" if setting == best else setting.label
            lines.append(f"| {server} | {name} | " + " | ".join(cells)
                         + f" | {_ms(top.p99_ms)} |")
    return "\n".join(lines)


def verdict_line(result: Verdict) -> str:
    rates = ", ".join(_rate(r) for r in result.rates)
    goodput = ("yes, at every rate tried" if not result.goodput_short
               else "no: " + "; ".join(result.goodput_short))
    knee_ok = "yes" if not result.knee_short else "no: " + "; ".join(result.knee_short)
    return (f"- batchserve's goodput at least each peer's (rates {rates} req/s): {goodput}.\n"
            f"- batchserve's knee at least each peer's: {knee_ok}.")


def model_block(runs: Sequence[Run], model: str, limit_ms: float,
                servers: Sequence[str]) -> str:
    """Everything measured for ``model``: summary, goodput by rate, verdict and the sweep."""
    peers = [s for s in servers if s != "batchserve"]
    measured = sorted(r.measured for r in runs if r.model == model)
    when = f"{measured[0]} to {measured[-1]}" if measured else "never"
    return "\n\n".join([
        f"### `{model}`, limit {limit_ms:g} ms (measured {when})",
        summary_table(runs, model, limit_ms, servers),
        f"Goodput within {limit_ms:g} ms, req/s (share of requests sent):",
        goodput_table(runs, model, servers),
        verdict_line(verdict(runs, model, peers)),
        "The peers' sweep:",
        sweep_table(runs, model, peers),
    ])
