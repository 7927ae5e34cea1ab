"""What `batchserve bench` reads from the server about itself, through its ``/metrics``.

Two readings around a run give the runner's mean batch size over that run (the batch-size
histogram's ``_sum`` and ``_count`` only grow) and its 503s by the reason the server counted
them under; one reading gives the runner's configured
``max_latency_ms``, the natural limit for goodput. A target that is not batchserve (no
``/metrics``, or something else there) is still benchmarked; only these figures go missing.
"""

from __future__ import annotations

import urllib.error

from .scrape import Scrape, fetch

BATCH_SIZE = "batchserve_adaptive_batch_size"
LATENCY_LIMIT = "batchserve_runner_latency_limit_seconds"
UNAVAILABLE = "batchserve_unavailable_total"


class Unreachable(Exception):
    """Nothing answers HTTP at the target's address."""


def read(base_url: str, timeout: float = 5.0) -> Scrape | None:
    """The server's metrics now; None when it answers but has none to give.

    Raises :class:`Unreachable` when no HTTP server answers at ``base_url`` at all.
    """
    try:
        return fetch(base_url, timeout)
    except urllib.error.HTTPError:
        return None  # an HTTP answer: the server is there, its /metrics is not
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"cannot reach {base_url}: {reason}") from None
    except ValueError:
        return None  # /metrics answered with something that is not Prometheus text


def latency_limit_ms(scrape: Scrape | None, runner: str) -> float | None:
    """The runner's ``max_latency_ms`` as its metrics state it; None when they do not."""
    if scrape is None:
        return None
    seconds = scrape.maximum(LATENCY_LIMIT, runner=runner)
    return seconds * 1e3 if seconds else None


def mean_batch_size(before: Scrape | None, after: Scrape | None, runner: str) -> float | None:
    """Rows per batch the runner ran between two readings; None without batches or metrics."""
    if before is None or after is None:
        return None
    rows = after.total(f"{BATCH_SIZE}_sum", runner=runner)
    rows -= before.total(f"{BATCH_SIZE}_sum", runner=runner)
    batches = after.total(f"{BATCH_SIZE}_count", runner=runner)
    batches -= before.total(f"{BATCH_SIZE}_count", runner=runner)
    return rows / batches if batches > 0 else None


def refusals(before: Scrape | None, after: Scrape | None, runner: str) -> dict[str, int] | None:
    """The runner's 503s between two readings by reason (the reason each 503's body names);
    None without metrics."""
    if before is None or after is None:
        return None
    then = before.by_label(UNAVAILABLE, "reason", runner=runner)
    now = after.by_label(UNAVAILABLE, "reason", runner=runner)
    counts = {reason: round(count - then.get(reason, 0.0)) for reason, count in now.items()}
    return {reason: count for reason, count in sorted(counts.items()) if count > 0}
