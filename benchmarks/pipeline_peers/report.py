"""What the command prints as it goes, and the section it writes into the docs."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from benchmarks.pipeline_peers import table


def line(record: Mapping[str, Any], limit_ms: float) -> str:
    load = record["load"]
    rows = record.get("step1_rows")
    wasted = "" if rows is None else (
        f", step-1 rows {rows:.0f}, for nothing {table.wasted_rows(rows, load['good'])}")
    if record.get("wasted_counter") is not None:
        wasted += f" (server's count {record['wasted_counter']:.0f})"
    return (f"  {record['server']} at {record['rate']:g} req/s: sent {load['sent']}, goodput "
            f"≤ {limit_ms:g} ms {load['goodput']:.0f}/s, p50 {load['ok_p50_ms'] or 0:.1f} ms, "
            f"p99 {load['ok_p99_ms'] or 0:.1f} ms, cpu {table.cpu_ms_per_request(record):.2f} "
            f"ms/req, 503 {100 * table.share_503(record):.1f}%, other "
            f"{100 * table.other_share(record):.1f}%{wasted}")


def markdown(state: Mapping[str, Any], args: argparse.Namespace, limit_ms: float) -> str:
    records = state["records"]
    sweep = [r for r in records if r["job"].startswith("sweep")]
    main = [r for r in records if not r["job"].startswith("sweep")]
    best = table.best_setting(sweep)
    parts = [
        f"Measured {state['began']}, {state['minutes']:.0f} minutes of measuring; "
        f"{args.seconds:g} s a window after {args.warmup_seconds:g} s of warm-up at up to "
        f"{args.warmup_rate:g} req/s, every server started fresh for each rate. The limit is "
        f"the pipeline's `max_latency_ms: {limit_ms:g}`; goodput counts answers within it "
        "(for the client's two calls, both answered 200 and the second within it, from the "
        "scheduled send time).",
        "",
        table.main_table(main, limit_ms),
        "",
        _verdicts(main, args),
        "",
        _settings(best),
        "",
        "mosec's sweep, each setting on a fresh server (goodput, answers within the limit a "
        "second; the best sum is the one measured above):",
        "",
        table.sweep_table(sweep),
    ]
    return "\n".join(parts)


def _verdicts(records: list[Any], args: argparse.Namespace) -> str:
    lines = []
    for rate, ours, theirs, held in table.goodput_verdicts(records):
        verdict = "at least mosec's" if held else f"{theirs - ours:,.1f}/s below mosec's"
        lines.append(f"- At {rate:,.0f} req/s the pipeline's goodput is {ours:,.1f}/s, "
                     f"mosec's {theirs:,.1f}/s: {verdict}.")
    low = table.low_load_p50(records, args.low_rate)
    if low is not None:
        pipeline, tokenize, text = low
        lines.append(
            f"- At {args.low_rate:g} req/s the pipeline's p50 is {pipeline:.1f} ms; its steps "
            f"called alone, {tokenize:.1f} ms (tokenize) and {text:.1f} ms (text), "
            f"{tokenize + text:.1f} ms summed: {pipeline - tokenize - text:+.1f} ms.")
    for record in table.wasted_under(records, 2 * args.knee):
        load, own = record["load"], record["wasted_counter"]
        wasted = table.wasted_rows(record["step1_rows"], load["good"])
        lines.append(
            f"- At {record['rate']:,.0f} req/s the pipeline's tokenize ran "
            f"{record['step1_rows']:,.0f} rows, {wasted:,} of them "
            f"({100 * wasted / max(record['step1_rows'], 1):.1f}%) for requests not answered "
            f"within the limit (the server's own count: {own:,.0f}){_reasons(record)}"
            f"{_by_runner(record)}.")
    return "\n".join(lines)


def _settings(best: tuple[int, int] | None) -> str:
    mosec = ("-" if best is None else
             f"two stages, each `append_worker(num=1, max_batch_size={best[0]}, "
             f"max_wait_time={best[1]})` (ms); the best of the sweep below")
    return "\n".join([
        "| server | batching |",
        "|---|---|",
        "| batchserve | `configuration.yml`: `tokenize` max_batch_size 64, max_latency_ms 50; "
        "`text` max_batch_size 64, max_batch_elements 4096, max_latency_ms 100, one torch "
        "thread; pipeline `classify` max_latency_ms 100; one API worker |",
        f"| mosec | {mosec}; the same tokenizer and model code, one torch thread |",
    ])


def _reasons(record: Mapping[str, Any]) -> str:
    """The 503s of a window by the reason their bodies name, most first."""
    counts = {reason: sum(values.values())
              for reason, values in record["load"]["retry_after_by_reason"].items()}
    if not counts:
        return ""
    said = ", ".join(f"`{reason}` {count:,}" for reason, count in
                     sorted(counts.items(), key=lambda item: -item[1]))
    return f"; its 503s by reason: {said}"


def _by_runner(record: Mapping[str, Any]) -> str:
    """What each step's runner refused itself."""
    refused = record.get("runner_refusals")
    if not refused or not any(refused.values()):
        return ""
    return (f"; refused by the runners themselves: {refused['tokenize']:,.0f} by `tokenize`, "
            f"{refused['text']:,.0f} by `text`")
