"""Retry-After: how long a refused client is told to wait, from the time the backlog needs.

A refusal in overload is not the end of that work: its client brings it back. Told to come
back after a constant second, every client refused in the last second returns at once, on top
of the new traffic, and most are refused again; the answers cost CPU and the server's capacity
goes to refusing. So a 503 says when the work it refused could be served: the predicted time
for the work ahead and the refused backlog to drain at the server's capacity (the runner's
`AdaptivePolicy`; the API worker's shedding in `batchserve.api.overload`). It grows with the
overload (about 2 s at twice the capacity, 5 s at five times) and falls back to the least
wait once the refusals stop (docs/protocol.md, the 503s under "Endpoints").
"""

from __future__ import annotations

import math

from .timeouts import Timeouts


def retry_after_s(drain_s: float) -> float:
    """Whole seconds for a predicted drain time, from `Timeouts.RETRY_AFTER_S` to
    `Timeouts.RETRY_AFTER_MAX_S`."""
    if not math.isfinite(drain_s):
        return Timeouts.RETRY_AFTER_MAX_S
    return min(Timeouts.RETRY_AFTER_MAX_S,
               max(Timeouts.RETRY_AFTER_S, float(math.ceil(drain_s))))
