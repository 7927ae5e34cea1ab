"""A runner process wakes per batch, not per request: counted on real processes.

The runner reads its API workers' connections only while its model is free; what comes
while a batch runs waits in the socket and is read in one go when the batch ends. So its reads
of calls (`batchserve_runner_reads_total`) follow its batches, not its requests.
"""

from __future__ import annotations

import asyncio
import json

from prometheus_client.parser import text_string_to_metric_families

from batchserve.api.bench.loadgen import run_load
from tests.conftest import Server

NAPPING = """
runners:
  nap:
    model: fixture_models:napping_echo
    batching: {max_batch_size: 256, max_latency_ms: 2000}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""
BODY = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                               "data": [1.0, 2.0, 3.0, 4.0]}]}).encode()


def total(text: str, name: str) -> float:
    """A metric's samples summed over every process and label."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)


def test_a_runner_reads_once_per_batch_and_api_worker_not_once_per_request(
    serve: object,
) -> None:
    # Each batch naps 40 ms; at 400 requests a second about 16 arrive while one runs, each
    # on its own: read one by one, every arrival would be a read of its own.
    server: Server = serve(NAPPING, "--api-workers", "2")  # type: ignore[operator]
    with server.client() as client:
        before = client.get("/metrics").text
    result = asyncio.run(run_load(f"{server.url}/v2/models/nap/infer", BODY,
                                  {"Content-Type": "application/json"}, rate=400, seconds=2.0,
                                  max_connections=64, slo_ms=2000))
    assert result.sent >= 400 and result.ok == result.sent, result
    with server.client() as client:
        after = client.get("/metrics").text
    reads = total(after, "batchserve_runner_reads_total") - total(
        before, "batchserve_runner_reads_total")
    batches = total(after, "batchserve_batches_total") - total(before, "batchserve_batches_total")
    assert batches >= 10  # traffic kept the model busy: every request met a running batch
    assert result.sent / batches >= 8  # and batches held many requests each
    # Two API workers: a read of each that finds the model busy, and the read of what they
    # held once it frees, for each batch; arrivals in the millisecond between a batch's end
    # and the next launch are read at once, to join it (about one a batch at 400 a second).
    # With one read a request, 8 or more.
    assert reads <= (2 * 2 + 1) * batches + 2 * 2, (reads, batches, result.sent)
    assert reads < result.sent / 3, (reads, batches, result.sent)
