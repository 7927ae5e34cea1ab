"""Open-loop load over gRPC: one serialized `ModelInferRequest` sent at scheduled times.

The gRPC side of `batchserve.api.bench.loadgen`, measured the same way: every send time is
drawn before the run (`batchserve.api.bench.traffic`) and a call's latency runs from it, so a
stalled server shows in the latencies. Calls go out on `grpc.aio` over one channel or a few,
each an HTTP/2 connection of its own that carries any number of calls at once, the request
serialized once and sent as bytes. A failed call is recorded under the HTTP status of the
same decision (`batchserve.api.client.grpc_codec.http_status`: UNAVAILABLE is 503, ...), with
its reason and `retry-after` read from its trailing metadata, so the report reads as HTTP's
does; a call still unanswered `drain_timeout` after the last send is a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from ..client.grpc_codec import METHODS, http_status, trailers_of
from .load_result import TIMEOUT, TRANSPORT_ERROR, LoadResult, Sends, status_name, summarize
from .loadgen import Progress
from .traffic import Pattern, schedule

__all__ = ["OWN_CONNECTION", "run_grpc_load"]

OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
"""Channel options that give a channel a connection of its own: by default grpcio's channels
to one address share a single connection, so several would still be one."""


class _GrpcRun:
    """State of one run: per-call records, the channels' callables, the error samples."""

    def __init__(self, offsets: list[float], calls: list[Callable[..., Any]],
                 timeout_s: float) -> None:
        n = len(offsets)
        self.offsets, self.calls, self.timeout_s = offsets, calls, timeout_s
        self.start = 0.0
        self.latencies = [0.0] * n
        self.statuses = [TIMEOUT] * n
        self.lags = [0.0] * n
        self.fired = self.answered = self.ok = 0
        self.last_done = self.last_write = 0.0
        self.samples: dict[str, str] = {}
        self.retries: dict[str, dict[str, int]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def one(self, index: int, body: bytes) -> None:
        call = self.calls[index % len(self.calls)]
        try:
            await call(body, timeout=self.timeout_s)
            status = 200
        except grpc.aio.AioRpcError as exc:
            status = self.failed(exc)
        now = time.perf_counter()
        self.latencies[index] = now - self.start - self.offsets[index]
        self.statuses[index] = status
        self.answered += 1
        self.ok += status == 200
        self.last_done = now

    def failed(self, exc: grpc.aio.AioRpcError) -> int:
        trailers = trailers_of(exc.trailing_metadata())
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not trailers:
            return TIMEOUT  # the client's own deadline: no answer in time
        status = (TRANSPORT_ERROR if exc.code() == grpc.StatusCode.UNAVAILABLE and not trailers
                  else http_status(exc.code(), trailers))
        self.samples.setdefault(status_name(status), f"{exc.code().name} {exc.details()}")
        if status == 503:
            reason = trailers.get("batchserve-reason", "none")
            by_delay = self.retries.setdefault(reason, {})
            delay = trailers.get("retry-after", "none")
            by_delay[delay] = by_delay.get(delay, 0) + 1
        return status

    def progress(self, seconds: float) -> Progress:
        elapsed = time.perf_counter() - self.start if self.start else 0.0
        return Progress(elapsed, seconds, len(self.offsets), self.fired, self.answered, self.ok)

    async def fire_all(self, body: bytes, progress: Callable[[Progress], None] | None,
                       seconds: float) -> None:
        """Send every call at its time (the loop's timers: late by up to a millisecond, which
        `lags` records and the latency includes)."""
        loop = asyncio.get_running_loop()
        self.start = time.perf_counter()
        shown = 0.0
        for index, offset in enumerate(self.offsets):
            delay = self.start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self.lags[index] = time.perf_counter() - self.start - offset
            task = loop.create_task(self.one(index, body))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            self.fired = index + 1
            self.last_write = time.perf_counter()
            if progress is not None and self.last_write - shown > 0.2:
                progress(self.progress(seconds))
                shown = self.last_write


async def run_grpc_load(
    target: str,
    body: bytes,
    rate: float,
    seconds: float,
    seed: int = 0,
    channels: int = 1,
    *,
    drain_timeout: float = 10.0,
    slo_ms: float = 100.0,
    pattern: Pattern = "poisson",
    progress: Callable[[Progress], None] | None = None,
) -> LoadResult:
    """Call `ModelInfer` with `body` (a serialized request) on `target` (HOST:PORT) at
    arrivals of `pattern` (mean `rate`/s) for `seconds`, over `channels` connections."""
    if channels < 1:
        raise ValueError(f"channels must be at least 1, got {channels}")
    opened = [grpc.aio.insecure_channel(target, options=OWN_CONNECTION) for _ in range(channels)]
    calls = [channel.unary_unary(METHODS["ModelInfer"]) for channel in opened]
    run = _GrpcRun(schedule(rate, seconds, seed, pattern), calls, seconds + drain_timeout)
    cpu0 = time.process_time()
    try:
        for channel in opened:  # connected before the clock starts, so setup is not measured
            await asyncio.wait_for(channel.channel_ready(), drain_timeout)
        await run.fire_all(body, progress, seconds)
        if run.tasks:
            await asyncio.wait(list(run.tasks), timeout=drain_timeout)
    except TimeoutError:
        run.samples[status_name(TRANSPORT_ERROR)] = f"cannot connect to {target}"
        run.statuses = [TRANSPORT_ERROR] * len(run.offsets)
    finally:
        for task in list(run.tasks):
            task.cancel()
        await asyncio.gather(*run.tasks, return_exceptions=True)
        for channel in opened:
            await channel.close()
    if progress is not None:
        progress(run.progress(seconds))
    cpu = time.process_time() - cpu0
    elapsed = run.last_done - run.start if run.last_done else seconds
    sends = Sends(len(run.offsets), run.fired, max(0.0, run.last_write - run.start))
    return summarize(
        rate, seconds, run.latencies, run.statuses, run.lags, elapsed, (channels, 0), cpu,
        slo_ms=slo_ms, sends=sends, samples=run.samples, retries=run.retries,
    )
