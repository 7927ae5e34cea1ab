"""What one open-loop run measured, computed from per-request records (pure, no I/O).

Apart from `batchserve.api.bench.loadgen` so the numbers a run reports can be checked on made-up
records, without a server or a clock.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TRANSPORT_ERROR = 0
"""Status recorded when the connection failed (refused, reset, malformed response)."""
TIMEOUT = -1
"""Status recorded when no answer came before the drain timeout after the last send."""

_STATUS_NAMES = {TRANSPORT_ERROR: "transport", TIMEOUT: "timeout"}


def status_name(status: int) -> str:
    """``"200"``, ``"503"``, ... for HTTP answers; ``"transport"`` or ``"timeout"`` otherwise."""
    return _STATUS_NAMES.get(status, str(status))


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 1]) of already sorted values."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class Sends:
    """How the client kept to its schedule: requests written to a socket, and when the last was.

    ``last_s`` counts from the run's start; past the run's length it means the client (its
    timer or its connection pool) fell behind the schedule.
    """

    scheduled: int
    written: int
    last_s: float


@dataclass(frozen=True)
class LoadResult:
    """What one open-loop run measured. Latencies are from each request's scheduled time.

    ``p*_ms`` cover every HTTP response whatever its status (what clients waited for);
    transport errors and timeouts have no latency and are counted only in ``error_fraction``,
    which maps a status (``"503"``, ``"transport"``, ``"timeout"``) to its share of ``sent``.
    ``timer_lag_*`` is how late this generator's timer fired: the part of every latency that
    is the client's own fault. ``loadgen_cpu_*`` is this process's CPU for the whole run.
    ``ok_p*_ms`` cover the 2xx answers only, ``refused_p*_ms`` the 503s, and ``good`` counts
    the 2xx answers within ``slo_ms``: what a live benchmark judges and calls goodput.

    ``offered_rate`` is what the schedule asked for (sends over the run's length; it differs
    a little from ``target_rate`` because arrivals are random), ``send_rate`` what the client
    managed to write: when it falls short, the client was the bottleneck, not the server.
    ``achieved_rate`` is 2xx answers per second and ``goodput`` the good ones per second, both
    over the run or until its last answer, whichever is longer. ``status_counts`` counts every
    outcome by status name, and ``error_samples`` keeps the start of the first body (or the
    error message) of each failed status. ``retry_after_by_reason`` counts the 503s by the
    reason each body names and the Retry-After it carried, `{"queue": {"2": 150}}`.
    """

    target_rate: float
    seconds: float
    sent: int
    answered: int
    ok: int
    achieved_rate: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    errors: float
    error_fraction: dict[str, float]
    timer_lag_p50_ms: float | None
    timer_lag_p99_ms: float | None
    peak_connections: int
    peak_queued: int
    loadgen_cpu_s: float
    loadgen_cpu_ms_per_req: float
    ok_p50_ms: float | None = None
    ok_p90_ms: float | None = None
    ok_p99_ms: float | None = None
    refused_p50_ms: float | None = None
    refused_p99_ms: float | None = None
    slo_ms: float = 100.0
    good: int = 0
    goodput: float = 0.0
    offered_rate: float = 0.0
    send_rate: float = 0.0
    status_counts: dict[str, int] = field(default_factory=dict)
    error_samples: dict[str, str] = field(default_factory=dict)
    retry_after_by_reason: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _count(statuses: Sequence[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for st in statuses:
        key = status_name(st)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def summarize(
    rate: float,
    seconds: float,
    latencies: Sequence[float],
    statuses: Sequence[int],
    lags: Sequence[float],
    elapsed: float,
    peaks: tuple[int, int],
    cpu_s: float,
    *,
    slo_ms: float = 100.0,
    sends: Sends | None = None,
    samples: Mapping[str, str] | None = None,
    retries: Mapping[str, Mapping[str, int]] | None = None,
) -> LoadResult:
    """Turn per-request records (seconds, statuses) into a :class:`LoadResult`."""
    sent = len(statuses)
    sends = sends or Sends(sent, sent, seconds)
    pairs = list(zip(latencies, statuses, strict=True))
    answered = sorted(lat * 1e3 for lat, st in pairs if st > 0)
    ok_ms = sorted(lat * 1e3 for lat, st in pairs if 200 <= st < 300)
    refused_ms = sorted(lat * 1e3 for lat, st in pairs if st == 503)
    counts = _count(statuses)
    failed = {k: v for k, v in counts.items() if not k.startswith("2")}
    lag_ms = sorted(lag * 1e3 for lag in lags)
    good = bisect.bisect_right(ok_ms, slo_ms)
    span = max(elapsed, seconds)  # answers still arriving after the last send count too
    return LoadResult(
        target_rate=rate,
        seconds=seconds,
        sent=sent,
        answered=len(answered),
        ok=len(ok_ms),
        achieved_rate=len(ok_ms) / span,
        p50_ms=percentile(answered, 0.50),
        p90_ms=percentile(answered, 0.90),
        p99_ms=percentile(answered, 0.99),
        max_ms=answered[-1] if answered else None,
        errors=(sent - len(ok_ms)) / sent if sent else 0.0,
        error_fraction={k: v / sent for k, v in failed.items()},
        timer_lag_p50_ms=percentile(lag_ms, 0.50),
        timer_lag_p99_ms=percentile(lag_ms, 0.99),
        peak_connections=peaks[0],
        peak_queued=peaks[1],
        loadgen_cpu_s=cpu_s,
        loadgen_cpu_ms_per_req=cpu_s * 1e3 / sent if sent else 0.0,
        ok_p50_ms=percentile(ok_ms, 0.50),
        ok_p90_ms=percentile(ok_ms, 0.90),
        ok_p99_ms=percentile(ok_ms, 0.99),
        refused_p50_ms=percentile(refused_ms, 0.50),
        refused_p99_ms=percentile(refused_ms, 0.99),
        slo_ms=slo_ms,
        good=good,
        goodput=good / span,
        offered_rate=sends.scheduled / seconds,
        send_rate=sends.written / max(seconds, sends.last_s),
        status_counts=counts,
        error_samples=dict(samples or {}),
        retry_after_by_reason={
            reason: dict(sorted(values.items(), key=_seconds_first))
            for reason, values in sorted((retries or {}).items())
        },
    )


def _seconds_first(item: tuple[str, int]) -> tuple[float, str]:
    """Retry-After values in order of seconds; anything else (an HTTP date, "none") last."""
    value = item[0]
    return (float(value), value) if value.isdigit() else (math.inf, value)
