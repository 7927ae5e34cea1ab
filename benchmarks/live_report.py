"""The live table's records and how they print: one row per client, rate and run.

Pure: takes results, returns text. What each column means is in ``benchmarks/README.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from benchmarks.live_clients import RunResult

RATIO_BAND = (1 / 1.5, 1.5)
"""Where the p99 of observed/predicted batch time must lie for the model to hold."""


@dataclass(frozen=True)
class Window:
    """What the server recorded during one run, from two readings of ``/metrics``."""

    ratio_p99: float | None  # p99 of observed / predicted-p99 batch time
    batches: int
    mean_batch: float | None
    cpu_ms_per_req: float | None
    codes: dict[str, float]  # answers the server counted, by status
    rejections: dict[str, float]  # refusals by reason
    model_cpu_ms_per_req: float | None = None  # of cpu_ms_per_req, the model thread's

    @property
    def model_holds(self) -> bool | None:
        if self.ratio_p99 is None:
            return None
        return RATIO_BAND[0] <= self.ratio_p99 <= RATIO_BAND[1]

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "model_holds": self.model_holds}


@dataclass(frozen=True)
class Row:
    run: int
    result: RunResult
    window: Window

    def as_dict(self) -> dict[str, object]:
        return {"run": self.run, **self.result.as_dict(), "server": self.window.as_dict()}


def num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}" if whole else "-"


def yes(flag: bool | None) -> str:
    return "-" if flag is None else "yes" if flag else "**no**"


HEAD = (
    "| client | rate | run | sent | OK | 503 % | other % | p50 ms | p99 ms | pass "
    "| ratio p99 | in band | mean batch | server CPU ms/req | send lag p99 ms |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|"
)


def markdown(rows: Sequence[Row], head: bool = True) -> str:
    lines = [HEAD] if head else []
    for row in rows:
        r, w = row.result, row.window
        lines.append(
            f"| {r.client} | {r.rate:g} | {row.run} | {r.sent} | {r.ok} | {pct(r.refused, r.sent)} "
            f"| {pct(r.other, r.sent)} | {num(r.p50_ms)} | {num(r.p99_ms)} | {yes(r.passed)} "
            f"| {num(w.ratio_p99, 2)} | {yes(w.model_holds)} | {num(w.mean_batch)} "
            f"| {num(w.cpu_ms_per_req, 2)} | {num(r.send_lag_p99_ms, 2)} |"
        )
    return "\n".join(lines)


def summary(rows: Mapping[str, Sequence[Row]]) -> str:
    """Per rate: runs passed of those made, per client, and windows where the model held."""
    rates = sorted({row.result.rate for client_rows in rows.values() for row in client_rows})
    lines = []
    for rate in rates:
        parts, held, windows = [], 0, 0
        for client, client_rows in rows.items():
            at = [row for row in client_rows if row.result.rate == rate]
            parts.append(f"{client} {sum(r.result.passed for r in at)}/{len(at)} passed")
            held += sum(bool(r.window.model_holds) for r in at)
            windows += len(at)
        lines.append(f"{rate:g} req/s: {', '.join(parts)}; "
                     f"ratio p99 within [0.67, 1.5] in {held}/{windows} windows")
    return "\n".join(lines)


def startup_note(seq: Mapping[str, object]) -> str:
    lag = float(seq.get("recovery_startup_s") or 0.0)  # type: ignore[arg-type]
    # Both shared processes are launched on schedule and start their clocks after their
    # interpreter's start-up; only the second one's start-up can be measured.
    return f" (give or take start-up: the recovery process took {lag:.2f} s)" if lag else ""


def overload_markdown(sequences: Sequence[Mapping[str, object]]) -> str:
    lines = [
        "| client | phase | rate | s | sent | OK | goodput req/s | 503 % | other % "
        "| p99 OK ms | p99 503 ms | send lag p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for seq in sequences:
        for phase in ("overload", "recovery"):
            r: RunResult = seq[phase]  # type: ignore[assignment]
            lines.append(
                f"| {r.client} | {phase} | {r.rate:g} | {r.seconds:g} | {r.sent} | {r.ok} "
                f"| {r.goodput:.0f} | {pct(r.refused, r.sent)} | {pct(r.other, r.sent)} "
                f"| {num(r.p99_ms)} | {num(r.refused_p99_ms)} | {num(r.send_lag_p99_ms, 2)} |"
            )
        after: RunResult = seq["recovery"]  # type: ignore[assignment]
        w: Window = seq["server"]  # type: ignore[assignment]
        notes.append(
            f"{seq['client']}: recovery started {seq['gap_s']:g} s after the overload's last "
            f"scheduled send{startup_note(seq)}; every request at {after.rate:g} req/s "
            f"answered OK: {yes(after.ok == after.sent)} ({after.ok}/{after.sent}); "
            f"whole sequence: ratio p99 {num(w.ratio_p99, 2)}, mean batch {num(w.mean_batch)}, "
            f"server CPU {num(w.cpu_ms_per_req, 2)} ms/req, refusals {w.rejections}"
        )
    return "\n".join(lines + [""] + notes)
