"""Triton's inference statistics (`GET /v2/models[/{name}]/stats`), read from the metrics.

Why from the metrics: every process already counts what the statistics ask for into the
Prometheus registry that `GET /metrics` merges, so the two cannot disagree. Only what the
metrics know exactly is stated, in Triton's units (counts, and nanoseconds summed):

    success, fail        answered 200, or with an error: requests and arrival-to-answer time
    queue                pieces of requests (a request over max_batch_size is cut into
                         several) and their wait from arrival at the runner to their batch
    inference_count      rows run (requests, for ragged or pad inputs)
    execution_count      batches run

Triton's per-request `compute_input`, `compute_infer` and `compute_output`, `batch_stats` and
`last_inference` are left out: the metrics time batches, not requests, and keep no clock time.
The runners counted are those this API tier started (a runner on another host keeps its own
metrics); `success` and `fail` count every API worker's answers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

_Totals = dict[str, float]
"""A runner's sums by what they count (`success_count`, `queue_ns`, ...)."""

_READ = {
    "batchserve_queue_wait_seconds_count": "queue_count",
    "batchserve_queue_wait_seconds_sum": "queue_s",
    "batchserve_adaptive_batch_size_sum": "inference_count",
    "batchserve_adaptive_batch_size_count": "execution_count",
}
_DURATION = "batchserve_request_duration_seconds"


def _key(name: str, labels: Mapping[str, str]) -> str | None:
    """Which total a sample adds to, if any."""
    if name in _READ:
        return _READ[name]
    if name in (f"{_DURATION}_count", f"{_DURATION}_sum"):
        outcome = "success" if labels.get("code") == "200" else "fail"
        return f"{outcome}_{'count' if name.endswith('_count') else 's'}"
    return None


def totals(registry: CollectorRegistry) -> dict[str, _Totals]:
    """Every runner's totals, from one collection of the registry."""
    found: dict[str, _Totals] = defaultdict(lambda: defaultdict(float))
    for family in registry.collect():
        for sample in family.samples:
            key = _key(sample.name, sample.labels)
            runner = sample.labels.get("runner")
            if key is not None and runner is not None:
                found[runner][key] += sample.value
    return found


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": round(count), "ns": round(seconds * 1e9)}


def model_stats(name: str, sums: Mapping[str, float]) -> dict[str, Any]:
    """One model's entry in Triton's shape (see the module's docstring)."""
    return {
        "name": name,
        "version": "1",
        "inference_count": round(sums.get("inference_count", 0.0)),
        "execution_count": round(sums.get("execution_count", 0.0)),
        "inference_stats": {
            "success": _duration(sums.get("success_count", 0.0), sums.get("success_s", 0.0)),
            "fail": _duration(sums.get("fail_count", 0.0), sums.get("fail_s", 0.0)),
            "queue": _duration(sums.get("queue_count", 0.0), sums.get("queue_s", 0.0)),
        },
    }


def encode(names: Iterable[str], registry: CollectorRegistry) -> bytes:
    """The statistics of the models `names`, in Triton's `{"model_stats": [...]}`."""
    found = totals(registry)
    return orjson.dumps({"model_stats": [model_stats(name, found.get(name, {}))
                                         for name in names]})
