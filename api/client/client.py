"""A Python client for batchserve, or any Open Inference Protocol v2 server, over HTTP or gRPC.

Three front ends over one core, `batchserve.api.client.codec`, and a transport each
(`batchserve.api.client.transports`: `http://HOST:PORT` or `grpc://HOST:PORT`):

    ModelClient          blocking calls; the chunks of a large batch go out on a thread pool
    AsyncModelClient     the same calls as coroutines, over httpx's or grpc.aio's channel
    FuturesModelClient   every call returns a `concurrent.futures.Future` at once

Each reads the model's metadata once (`GET /v2/models/{name}`, or over gRPC `ModelMetadata`
and `ModelConfig`). A batch with more rows than the
server's `max_batch_size` is cut by a chunking strategy (by default into slices along the
batch dimension), the chunks are sent in parallel (at most `max_workers` at a time), and their
outputs are joined in order. Every call has a deadline, `timeout_s`: a 503 with `Retry-After`
is tried again after that delay while the deadline allows, and otherwise raised as
`ServerUnavailable`; other error answers raise `ServerError` with the server's status and
message, and a deadline that passes first raises `DeadlineExceeded`. Over gRPC a status is the
HTTP status of the same decision (a refusal's reason and delay come in its trailing metadata),
so the same errors are raised with the same words. Connection failures raise httpx's own
`httpx.TransportError`, or over gRPC `ServerUnavailable` with gRPC's words and no reason.

Needs httpx: `pip install 'batchserve[client]'`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import numpy as np

from ...runner.core.types import Tensors
from .codec import (
    ChunkingStrategy,
    DeadlineExceeded,
    ModelMetadata,
    Parameters,
    Plan,
    ServerError,
    ServerUnavailable,
    TensorInfo,
    plan_call,
    split_along,
    split_first_dim,
)

try:
    from .transports import Retry, async_transport, transport
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "batchserve.api.client needs httpx: pip install 'batchserve[client]'"
    ) from exc

__all__ = [
    "AsyncModelClient",
    "ChunkingStrategy",
    "DeadlineExceeded",
    "FuturesModelClient",
    "ModelClient",
    "ModelMetadata",
    "Parameters",
    "ServerError",
    "ServerUnavailable",
    "TensorInfo",
    "split_along",
    "split_first_dim",
]

_T = TypeVar("_T")

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_WORKERS = 4


# --- what every front end shares ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Options:
    model: str
    timeout_s: float
    binary: bool
    chunking: ChunkingStrategy | None
    max_batch_size: int | None
    max_workers: int

    def __post_init__(self) -> None:
        # Refused here, at construction: a zero would otherwise hang or fail on first use.
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s has value {self.timeout_s!r}; expected seconds > 0")
        if self.max_workers < 1:
            raise ValueError(f"max_workers has value {self.max_workers!r}; expected at least 1")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(
                f"max_batch_size has value {self.max_batch_size!r}; expected at least 1"
            )

    def deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def plan(
        self, metadata: ModelMetadata, positional: Sequence[Any], named: Mapping[str, Any],
        sample: bool, parameters: Parameters | None,
    ) -> Plan:
        return plan_call(metadata, positional, named, sample=sample, chunking=self.chunking,
                         max_batch_size=self.max_batch_size, parameters=parameters)


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before the server answered")
    return remaining


# --- the blocking client ------------------------------------------------------------------------


class ModelClient:
    """Blocking inference on one model: `infer_batch` and `infer_sample` return named arrays.

    Safe to share between threads. Use it as a context manager, or call `close()`.
    """

    def __init__(
        self, url: str, model: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
        binary: bool = True, chunking: ChunkingStrategy | None = None,
        max_workers: int = DEFAULT_WORKERS, max_batch_size: int | None = None,
    ) -> None:
        """`url` is the server's base URL (`http://127.0.0.1:3000`), or its gRPC service's
        (`grpc://127.0.0.1:8001`). `binary=False` sends and asks for JSON tensors instead of
        the binary tensor data extension (over gRPC, typed `contents` instead of raw ones).
        `max_batch_size` overrides what the server's metadata says."""
        self._options = _Options(
            model, timeout_s, binary, chunking, max_batch_size, max_workers
        )
        self._transport = transport(url, model, timeout_s)
        self._lock = threading.Lock()
        self._metadata: ModelMetadata | None = None
        self._executor: ThreadPoolExecutor | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
        self._transport.close()

    def metadata(self) -> ModelMetadata:
        """The model's metadata, read from the server at the first call."""
        with self._lock:
            if self._metadata is None:
                deadline = self._options.deadline(None)
                self._metadata = self._exchange(deadline, self._transport.metadata)
            return self._metadata

    def infer_batch(
        self, *inputs: np.ndarray, timeout_s: float | None = None,
        parameters: Parameters | None = None, **named: np.ndarray
    ) -> Tensors:
        """Outputs by name for a batch of rows, given by position (in the model's input
        order) or by name; `timeout_s` overrides the client's deadline for this call."""
        return self._infer(inputs, named, timeout_s, parameters, sample=False)

    def infer_sample(
        self, *inputs: np.ndarray, timeout_s: float | None = None,
        parameters: Parameters | None = None, **named: np.ndarray
    ) -> Tensors:
        """As `infer_batch` for one row given without its batch dimension."""
        return self._infer(inputs, named, timeout_s, parameters, sample=True)

    def _infer(
        self, positional: Sequence[Any], named: Mapping[str, Any], timeout_s: float | None,
        parameters: Parameters | None, sample: bool,
    ) -> Tensors:
        deadline = self._options.deadline(timeout_s)
        plan = self._options.plan(self.metadata(), positional, named, sample, parameters)
        if len(plan.chunks) == 1:  # no thread hop for the common case
            return plan.finish([self._send(plan.chunks[0], deadline, plan.parameters)])
        answer: Future[Tensors] = Future()
        answer.set_running_or_notify_cancel()
        self._fan_out(plan, deadline, answer)
        return answer.result()

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._options.max_workers, "batchserve-client")
            return self._executor

    def _fan_out(self, plan: Plan, deadline: float, answer: Future[Tensors]) -> None:
        """Send every chunk on the pool; `answer` gets the joined outputs or the first error."""
        pool = self._pool()
        parts = [pool.submit(self._send, chunk, deadline, plan.parameters)
                 for chunk in plan.chunks]
        _gather(parts, plan.finish, answer)

    def _send(self, inputs: Tensors, deadline: float, parameters: Parameters) -> Tensors:
        metadata = self.metadata()
        binary = self._options.binary

        def call(remaining: float) -> Tensors:
            return self._transport.infer(inputs, metadata, binary, parameters, remaining)

        return self._exchange(deadline, call)

    def _exchange(self, deadline: float, call: Callable[[float], _T]) -> _T:
        """One call of the transport, given the seconds left, retried while the server
        refuses with a delay that fits the deadline."""
        while True:
            try:
                return call(_remaining(deadline))
            except Retry as retry:
                time.sleep(retry.delay_s)


def _gather(
    parts: list[Future[Tensors]], finish: Callable[[Sequence[Tensors]], Tensors],
    answer: Future[Tensors],
) -> None:
    """Settle `answer` once every part is done; the first failure cancels the parts not yet
    started, and the first in order is the one raised."""
    left = len(parts)
    lock = threading.Lock()

    def done(part: Future[Tensors]) -> None:
        nonlocal left
        if not part.cancelled() and part.exception() is not None:
            for other in parts:
                other.cancel()
        with lock:
            left -= 1
            if left:
                return
        errors = [p.exception() for p in parts if not p.cancelled() and p.exception()]
        if errors:
            answer.set_exception(errors[0])
            return
        try:
            answer.set_result(finish([part.result() for part in parts]))
        except Exception as exc:  # a join that fails (a custom strategy's odd chunks)
            answer.set_exception(exc)

    for part in parts:
        part.add_done_callback(done)


# --- futures ------------------------------------------------------------------------------------


class FuturesModelClient:
    """As `ModelClient`, but every call returns a `Future` at once; the work runs on a pool of
    `max_workers` threads, which also carries the chunks of large batches."""

    def __init__(
        self, url: str, model: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
        binary: bool = True, chunking: ChunkingStrategy | None = None,
        max_workers: int = DEFAULT_WORKERS, max_batch_size: int | None = None,
    ) -> None:
        self._client = ModelClient(
            url, model, timeout_s=timeout_s, binary=binary, chunking=chunking,
            max_workers=max_workers, max_batch_size=max_batch_size,
        )
        self._pending: set[Future[Tensors]] = set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the calls under way (each ends by its deadline), then close."""
        wait(list(self._pending))
        self._client.close()

    def metadata(self) -> Future[ModelMetadata]:
        return self._client._pool().submit(self._client.metadata)

    def infer_batch(
        self, *inputs: np.ndarray, timeout_s: float | None = None,
        parameters: Parameters | None = None, **named: np.ndarray
    ) -> Future[Tensors]:
        """See `ModelClient.infer_batch`; the deadline runs from this call."""
        return self._submit(inputs, named, timeout_s, parameters, sample=False)

    def infer_sample(
        self, *inputs: np.ndarray, timeout_s: float | None = None,
        parameters: Parameters | None = None, **named: np.ndarray
    ) -> Future[Tensors]:
        return self._submit(inputs, named, timeout_s, parameters, sample=True)

    def _submit(
        self, positional: Sequence[Any], named: Mapping[str, Any], timeout_s: float | None,
        parameters: Parameters | None, sample: bool,
    ) -> Future[Tensors]:
        client = self._client
        deadline = client._options.deadline(timeout_s)
        answer: Future[Tensors] = Future()
        answer.set_running_or_notify_cancel()

        def start() -> None:
            # Plans and hands the chunks to the pool without waiting for them, so a pool full
            # of started calls can never wait on itself.
            try:
                plan = client._options.plan(client.metadata(), positional, named, sample,
                                            parameters)
                client._fan_out(plan, deadline, answer)
            except Exception as exc:
                answer.set_exception(exc)

        self._pending.add(answer)
        answer.add_done_callback(self._pending.discard)
        client._pool().submit(start)
        return answer


# --- asyncio ------------------------------------------------------------------------------------


class AsyncModelClient:
    """As `ModelClient`, with coroutines; use it with `async with` or call `aclose()`."""

    def __init__(
        self, url: str, model: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
        binary: bool = True, chunking: ChunkingStrategy | None = None,
        max_workers: int = DEFAULT_WORKERS, max_batch_size: int | None = None,
    ) -> None:
        """`max_workers` bounds the chunks of one call in flight at once."""
        self._options = _Options(
            model, timeout_s, binary, chunking, max_batch_size, max_workers
        )
        self._transport = async_transport(url, model, timeout_s)
        self._metadata: ModelMetadata | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def metadata(self) -> ModelMetadata:
        if self._metadata is None:  # two first calls at once both read it: harmless
            deadline = self._options.deadline(None)
            self._metadata = await self._exchange(deadline, self._transport.metadata)
        return self._metadata

    async def infer_batch(
        self, *inputs: np.ndarray, timeout_s: float | None = None,
        parameters: Parameters | None = None, **named: np.ndarray
    ) -> Tensors:
        """See `ModelClient.infer_batch`."""
        return await self._infer(inputs, named, timeout_s, parameters, sample=False)

    async def infer_sample(
        self, *inputs: np.ndarray, timeout_s: float | None = None,
        parameters: Parameters | None = None, **named: np.ndarray
    ) -> Tensors:
        return await self._infer(inputs, named, timeout_s, parameters, sample=True)

    async def _infer(
        self, positional: Sequence[Any], named: Mapping[str, Any], timeout_s: float | None,
        parameters: Parameters | None, sample: bool,
    ) -> Tensors:
        deadline = self._options.deadline(timeout_s)
        plan = self._options.plan(await self.metadata(), positional, named, sample,
                                  parameters)
        if len(plan.chunks) == 1:
            return plan.finish([await self._send(plan.chunks[0], deadline, plan.parameters)])
        slots = asyncio.Semaphore(self._options.max_workers)

        async def send(chunk: Tensors) -> Tensors:
            async with slots:
                return await self._send(chunk, deadline, plan.parameters)

        tasks = [asyncio.create_task(send(chunk)) for chunk in plan.chunks]
        try:
            answers = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # none left running
            raise
        return plan.finish(answers)

    async def _send(
        self, inputs: Tensors, deadline: float, parameters: Parameters
    ) -> Tensors:
        metadata = await self.metadata()
        binary = self._options.binary

        async def call(remaining: float) -> Tensors:
            return await self._transport.infer(inputs, metadata, binary, parameters, remaining)

        return await self._exchange(deadline, call)

    async def _exchange(self, deadline: float, call: Callable[[float], Awaitable[_T]]) -> _T:
        """As `ModelClient._exchange`."""
        while True:
            try:
                return await call(_remaining(deadline))
            except Retry as retry:
                await asyncio.sleep(retry.delay_s)
