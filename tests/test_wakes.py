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
from batchserve.runner.core.config import RunnerConfig, TensorSpec
from batchserve.runner.core.wire import Ping, encode
from batchserve.runner.server import Connection
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


class Transport:
    """What a runner's connection does to its socket, counted."""

    def __init__(self) -> None:
        self.paused = 0
        self.written: list[bytes] = []

    def pause_reading(self) -> None:
        self.paused += 1

    def is_closing(self) -> bool:
        return False

    def writelines(self, chunks: list[bytes]) -> None:
        self.written += [bytes(chunk) for chunk in chunks]

    def get_extra_info(self, name: str) -> None:
        return None


class Busy:
    """A dispatcher whose model is running: it would hold every connection it is asked to."""

    class metrics:  # noqa: N801 - the attribute the connection counts its reads on
        class reads:  # noqa: N801
            @staticmethod
            def inc() -> None:
                pass

    def gather(self) -> None:
        pass

    def gathered(self) -> None:
        pass

    def hold(self, reader: object) -> bool:
        return True


def test_a_runner_holds_a_connection_between_calls_never_in_the_middle_of_one() -> None:
    # A call larger than the socket's buffer comes in over several reads; held after the
    # first, the rest would wait for the batch to end, and cross one buffer a batch.
    async def reads() -> tuple[int, int, int]:
        runner = RunnerConfig(name="m", model="m:m", inputs=(TensorSpec("x", "FP32", (-1,)),),
                              outputs=(TensorSpec("y", "FP32", (-1,)),))
        connection = Connection(runner, Busy(), set())  # type: ignore[arg-type]
        transport = Transport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        connection.greeting = None  # the handshake passed
        frame = b"".join(bytes(chunk) for chunk in encode(Ping(1)))
        counts = []
        for piece in (frame[:3], frame[3:-1], frame[-1:]):
            buffer = connection.get_buffer(-1)
            buffer[: len(piece)] = piece
            connection.buffer_updated(len(piece))
            counts.append(transport.paused)
        return counts[0], counts[1], counts[2]

    assert asyncio.run(reads()) == (0, 0, 1)  # held only once the ping is whole
