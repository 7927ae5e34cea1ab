"""How many requests a second one runner process can take within its limit, as it runs now.

Two things bound it, and the capacity is the lower:

- **The model.** A request that arrives while a batch runs waits for it and then for its own
  batch, so within a limit `L` a batch may take at most `L / 2` at the high quantile: the
  largest such batch `n` (at most `max_batch_size`) run back to back serves
  `n / mean(n)` rows a second.
- **The cores.** Every request also costs CPU outside the model's batch: in the API workers
  that decode and answer it, and in the runner's own event loop. Those costs are measured,
  per request, as the server runs; the model's CPU per row at batch `n` comes from the
  latency model's cost curve. Part of what a request costs outside the model is its batch's
  share of what every batch costs whatever it holds (wake-ups and frames, in the runner and
  in the API workers): where the meter could separate that part, the requests are priced in
  batches of `n`, as they run at capacity (or in the largest batches it saw lately, if
  smaller), not in the smaller batches of the moment. The cores the server can use are
  those it uses now plus those left idle (other processes on the machine keep theirs),
  shared evenly among the runner's processes.

This is pure arithmetic over what the caller measured: the runner's metrics feed it
(`batchserve.runner.metrics`), and the same function can be fed by a plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .latency_model import Fit


@dataclass(frozen=True, slots=True)
class Load:
    """What one runner process measured lately, per request and for the machine."""

    rows_per_request: float
    """Mean rows (or elements) per request lately."""
    front_s: float
    """API worker CPU seconds per request (decoding, dispatch, the answer)."""
    loop_s: float
    """The runner process's CPU seconds per request outside its model thread."""
    used_cores: float
    """Cores the server uses now for this process's requests (front, loop and model)."""
    idle_cores: float
    """Cores the whole machine leaves idle now."""
    processes: int = 1
    """The runner's processes, which share the idle cores."""
    cores: float = float("inf")
    """The cores this process may run on at all (affinity, quota)."""
    batches_per_request: float = 1.0
    """Batches run per request lately (1 / requests a batch)."""
    batch_s: float = 0.0
    """Of `front_s + loop_s`, the CPU seconds each batch costs whatever it holds, spread over
    its requests (0 where the meter could not tell it apart)."""
    fewest_batches_per_request: float = 0.0
    """The fewest batches per request in the spans `batch_s` was told from: beyond them the
    line it came from is not trusted."""


def batch_within(fit: Fit, max_latency_s: float, max_batch_size: int) -> int:
    """The largest batch whose high-quantile time is at most half the limit (at least 1)."""
    half_s = max_latency_s / 2.0
    if fit.slope_s <= 0.0:
        return max_batch_size if fit.high(max_batch_size) <= half_s else 1
    largest = (half_s / max(fit.factor, 1e-9) - fit.intercept_s) / fit.slope_s
    return max(1, min(max_batch_size, int(largest)))


def model_rate(fit: Fit, rows: int, rows_per_request: float) -> float:
    """Requests a second the model serves in batches of `rows`, back to back."""
    mean_s = fit.mean(rows)
    if mean_s <= 0.0:
        return math.inf
    return rows / mean_s / max(rows_per_request, 1e-9)


def core_rate(fit: Fit, rows: int, load: Load) -> float:
    """Requests a second the cores this process may use can pay for, batches of `rows`."""
    model_s = fit.curve(rows) / rows * load.rows_per_request if rows > 0 else 0.0
    at_capacity = load.rows_per_request / rows if rows > 0 else load.batches_per_request
    at_capacity = max(at_capacity, load.fewest_batches_per_request)
    spared_s = load.batch_s * max(0.0, load.batches_per_request - at_capacity)
    per_request_s = load.front_s + load.loop_s - spared_s + model_s
    if per_request_s <= 0.0:
        return math.inf
    cores = min(load.cores, load.used_cores + load.idle_cores / max(load.processes, 1))
    return cores / per_request_s


def capacity(fit: Fit, max_latency_s: float, max_batch_size: int, load: Load) -> float:
    """The sustainable requests a second within the limit: 0 before the model is fitted."""
    if fit.samples == 0 or fit.mean(1) <= 0.0:
        return 0.0
    rows = batch_within(fit, max_latency_s, max_batch_size)
    return min(model_rate(fit, rows, load.rows_per_request), core_rate(fit, rows, load))
