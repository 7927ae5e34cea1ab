"""A sweep's results as `batchserve bench` reports them: JSON, a markdown table, warnings.

One :class:`Step` per rate of the sweep: what the client measured (a
:class:`~batchserve.api.bench.load_result.LoadResult`) and what the server said it did (its mean
batch size, its 503s by reason), with the Retry-After of each 503 the client received by
the reason its body names. The table keeps the columns a user compares across rates; the
JSON keeps everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from .load_result import LoadResult

SEND_SHORTFALL = 0.95
"""Below this share of the offered rate actually sent, the client is said to be the bottleneck."""


@dataclass(frozen=True)
class Step:
    """One rate of a sweep."""

    pattern: str
    load: LoadResult
    mean_batch_size: float | None
    refusals: dict[str, int] | None = None
    """The server's 503s over the step by reason; None when its metrics do not say."""

    def as_dict(self) -> dict[str, object]:
        return {"pattern": self.pattern, "mean_batch_size": self.mean_batch_size,
                "refusals_by_reason": self.refusals, **self.load.as_dict()}


@dataclass(frozen=True)
class Report:
    """Every step of a sweep, and what they were measured against."""

    url: str
    model: str
    limit_ms: float
    limit_source: str
    steps: tuple[Step, ...]

    @property
    def ok(self) -> int:
        return sum(step.load.ok for step in self.steps)

    def error_samples(self) -> dict[str, str]:
        """The first sample of each failed status across the sweep."""
        samples: dict[str, str] = {}
        for step in self.steps:
            for status, body in step.load.error_samples.items():
                samples.setdefault(status, body)
        return samples

    def as_json(self) -> bytes:
        head = {"url": self.url, "model": self.model, "limit_ms": self.limit_ms,
                "limit_source": self.limit_source}
        steps = [step.as_dict() for step in self.steps]
        return orjson.dumps({**head, "steps": steps}, option=orjson.OPT_INDENT_2)


COLUMNS = (
    "pattern", "offered req/s", "sent req/s", "ok req/s", "2xx", "503", "other",
    "p50 ms", "p90 ms", "p99 ms", "503 p50 ms", "503 p99 ms", "goodput req/s", "mean batch",
    "503 by reason", "Retry-After by reason",
)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _row(step: Step) -> tuple[str, ...]:
    load = step.load
    refused = load.status_counts.get("503", 0)
    batch = "-" if step.mean_batch_size is None else f"{step.mean_batch_size:.1f}"
    return (
        step.pattern, f"{load.offered_rate:.1f}", f"{load.send_rate:.1f}",
        f"{load.achieved_rate:.1f}", str(load.ok), str(refused), str(load.sent - load.ok - refused),
        _ms(load.ok_p50_ms), _ms(load.ok_p90_ms), _ms(load.ok_p99_ms),
        _ms(load.refused_p50_ms), _ms(load.refused_p99_ms), f"{load.goodput:.1f}", batch,
        _reasons(step.refusals), _retry_afters(load.retry_after_by_reason),
    )


def _reasons(refusals: dict[str, int] | None) -> str:
    if refusals is None:
        return "-"
    return ", ".join(f"{reason} {count}" for reason, count in refusals.items()) or "none"


def _retry_afters(retries: dict[str, dict[str, int]]) -> str:
    """`queue 150×2 s, 12×3 s; front 40×1 s`: how many 503s of each reason said each wait."""
    if not retries:
        return "none"
    return "; ".join(
        f"{reason} " + ", ".join(f"{count}×{_wait(value)}" for value, count in values.items())
        for reason, values in retries.items()
    )


def _wait(value: str) -> str:
    return f"{value} s" if value.isdigit() else value


def markdown(report: Report) -> str:
    """One row per step; latencies are of the 2xx answers, counted from the scheduled send."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(_row(step)) + " |" for step in report.steps),
    ]
    caption = (f"{report.url} model {report.model}: goodput counts 2xx answers within "
               f"{report.limit_ms:g} ms ({report.limit_source}).")
    return caption + "\n\n" + "\n".join(lines) + "\n"


def warnings(steps: Sequence[Step]) -> list[str]:
    """Lines for stderr about steps whose client could not send what it offered."""
    out = []
    for step in steps:
        load = step.load
        if load.send_rate < SEND_SHORTFALL * load.offered_rate:
            out.append(
                f"warning: at {load.target_rate:g} req/s the client sent {load.send_rate:.1f} "
                f"of {load.offered_rate:.1f} req/s offered (timer lag p99 "
                f"{_ms(load.timer_lag_p99_ms)} ms, peak queued client-side {load.peak_queued}, "
                f"failed connections: {load.status_counts.get('transport', 0)}); "
                "latencies at this rate include the client's own delay"
            )
    return out
