"""The comparison's figures and tables, from the records the runs keep (pure: no I/O).

A record is one measured window as a dict (kept in the command's JSON file): which server
(`pipeline`, `client`, `mosec`, or a step called alone: `tokenize`, `text`), the offered
rate, what the client saw (`load`, a `LoadResult` as a dict), the CPU of the server's whole
process tree, the rows and batches its first step (tokenize) ran, and for batchserve's
pipeline its own count of step-1 rows that ran for nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Record = Mapping[str, Any]

NAMES = {
    "pipeline": "batchserve, pipeline `classify`",
    "client": "batchserve, client calls tokenize then text",
    "mosec": "mosec, two-stage pipeline",
}


def wasted_rows(step1_rows: float, good: int) -> int:
    """Step-1 rows that ran for a request not answered 200 within the limit: every row the
    first step ran, less one a good answer (a request is one row)."""
    return max(0, round(step1_rows) - good)


def cpu_ms_per_request(record: Record) -> float:
    sent = record["load"]["sent"]
    return 1000 * record["cpu_s"] / sent if sent else 0.0


def share_503(record: Record) -> float:
    return float(record["load"]["error_fraction"].get("503", 0.0))


def other_share(record: Record) -> float:
    shares = record["load"]["error_fraction"]
    return sum(v for k, v in shares.items() if k != "503")


def best_setting(sweep: Sequence[Record]) -> tuple[int, int] | None:
    """mosec's (max_batch_size, max_wait_ms) with the most goodput summed over the sweep's
    rates (the first such on a tie)."""
    totals: dict[tuple[int, int], float] = {}
    for record in sweep:
        key = (int(record["max_batch_size"]), int(record["max_wait_ms"]))
        totals[key] = totals.get(key, 0.0) + record["load"]["goodput"]
    return max(totals, key=lambda k: totals[k]) if totals else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _pct(share: float) -> str:
    return f"{100 * share:.1f}"


def row(record: Record) -> str:
    load = record["load"]
    good = int(load["good"])
    rows = record.get("step1_rows")
    wasted = "-" if rows is None else f"{wasted_rows(rows, good):,}"
    own = record.get("wasted_counter")
    if own is not None:
        wasted += f" ({round(own):,})"
    step1 = "-" if rows is None else f"{round(rows):,} / {round(record['step1_batches']):,}"
    return (f"| {record['rate']:,.0f} | {NAMES[record['server']]} | {load['sent']:,} "
            f"| {load['goodput']:,.0f} | {_ms(load['ok_p50_ms'])} | {_ms(load['ok_p99_ms'])} "
            f"| {cpu_ms_per_request(record):.2f} | {_pct(share_503(record))} "
            f"| {_pct(other_share(record))} | {step1} | {wasted} |")


HEADER = (
    "| rate req/s | server | sent | goodput ≤ {limit} ms req/s | p50 ms | p99 ms "
    "| server CPU ms/req | 503 % | other non-OK % | step-1 rows / batches run "
    "| step-1 rows run for nothing |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main_table(records: Sequence[Record], limit_ms: float) -> str:
    """One row per rate and server, in that order."""
    order = {name: i for i, name in enumerate(NAMES)}
    chosen = sorted((r for r in records if r["server"] in NAMES),
                    key=lambda r: (r["rate"], order[r["server"]]))
    return "\n".join([HEADER.format(limit=f"{limit_ms:g}"), *(row(r) for r in chosen)])


def sweep_table(sweep: Sequence[Record]) -> str:
    """mosec's settings, goodput at each sweep rate."""
    rates = sorted({r["rate"] for r in sweep})
    keys = sorted({(int(r["max_batch_size"]), int(r["max_wait_ms"])) for r in sweep})
    head = ("| max_batch_size | max_wait_time ms | "
            + " | ".join(f"goodput at {rate:,.0f} req/s" for rate in rates) + " |")
    lines = [head, "|---:|---:|" + "---:|" * len(rates)]
    for batch, wait in keys:
        cells = []
        for rate in rates:
            found = [r for r in sweep if r["rate"] == rate and r["max_batch_size"] == batch
                     and r["max_wait_ms"] == wait]
            cells.append(f"{found[0]['load']['goodput']:,.0f}" if found else "-")
        lines.append(f"| {batch} | {wait} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goodput_verdicts(records: Sequence[Record]) -> list[tuple[float, float, float, bool]]:
    """Per rate with both measured: (rate, the pipeline's goodput, mosec's, pipeline ≥ mosec)."""
    by = {(r["server"], r["rate"]): r["load"]["goodput"] for r in records}
    rates = sorted({rate for server, rate in by if server == "pipeline"})
    out = []
    for rate in rates:
        if ("mosec", rate) in by:
            ours, theirs = by[("pipeline", rate)], by[("mosec", rate)]
            out.append((rate, ours, theirs, ours >= theirs))
    return out


def low_load_p50(records: Sequence[Record], rate: float) -> tuple[float, float, float] | None:
    """At ``rate``: the pipeline's p50 and the p50s of its two steps called alone."""
    p50 = {r["server"]: r["load"]["ok_p50_ms"] for r in records if r["rate"] == rate}
    if any(p50.get(name) is None for name in ("pipeline", "tokenize", "text")):
        return None
    return p50["pipeline"], p50["tokenize"], p50["text"]


def wasted_under(records: Sequence[Record], rate: float) -> list[Record]:
    """The pipeline's windows at ``rate`` or below with a server count of wasted rows."""
    return sorted((r for r in records if r["server"] == "pipeline" and r["rate"] <= rate
                   and r.get("wasted_counter") is not None), key=lambda r: r["rate"])
