"""The inference path of an API worker: one request from its body to its one answer.

A request is decoded and checked against the runner's signature here, so a runner only ever
sees tensors that fit; its deadline starts when the whole request has arrived, and whatever
time is left is what the runner is given. Nothing here awaits: a request is decoded, admitted
and sent in one go, and answered from the callback its runner's answer arrives in, so a
request costs no task, no timer and no event-loop turn of its own. Whoever carries the HTTP
exchange (`batchserve.api.http.connection` in a worker, the ASGI app in-process) hands the body in
and gets the answer through `Respond`.

A JSON body of `OFF_LOOP_BYTES` or more is the exception: it is decoded on the service's
decoding thread, and the request goes on from a callback on the loop once it is. Its decoding
takes milliseconds a megabyte, time in which the loop would answer nobody else; on the thread
the loop gets the interpreter back between the decoder's steps (a step, such as orjson
reading the whole body, still holds it: binary tensors are the answer for big ones).

HTTP and gRPC are two doors into this one exchange: `Exchange` reads a v2 JSON or binary body
and writes its answer; the gRPC door (`batchserve.api.grpc.door`) subclasses it to read a
`ModelInferRequest` and write a `ModelInferResponse`, and everything between (admission,
shedding, the backlog, deadlines, dispatch, splitting, errors, metrics) is the same code.

Errors of every kind leave through `error_response`. Every answer is counted once in
`batchserve_requests_total` by status, and every 503 once more in
`batchserve_unavailable_total` by its reason (see `batchserve.api.errors`).

Draining (`Service.stop`, called by the worker on SIGTERM): readiness turns 503 at once, new
inference requests are answered 503 (`draining`) before any work, and the requests already
accepted go on until they are answered (`Service.idle`) or the grace period ends, when those
still waiting on a runner are answered 503 (`Service.abandon`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

from prometheus_client import Counter, Gauge, Histogram

from ..runner.core.config import Config, RunnerConfig
from ..runner.core.retry import retry_after_s
from ..runner.core.security import Credentials
from ..runner.core.timeouts import Timeouts
from ..runner.core.types import Tensors
from ..runner.core.wire import Address
from ..runner.metrics import SECONDS_BUCKETS, Count, Tally
from . import admission, protocol
from .backlog import Published
from .dispatch import NO_KEYS, Pool
from .errors import (
    BacklogRefused,
    BatchserveError,
    ModelNotFound,
    Overloaded,
    Stopping,
    Unavailable,
    error_response,
)
from .failures import outputs_of
from .overload import Gate, Shedder, backlog_s
from .pipeline import Chain, Route
from .reserve import Reserve

log = logging.getLogger("batchserve.api.app")
VERSION = "1"

Respond = Callable[[int, bytes, Mapping[str, str]], None]
"""Writes one answer: status, body, headers. Called exactly once per request."""
ExchangeT = TypeVar("ExchangeT", bound="Exchange")

OFF_LOOP_BYTES = 1 << 20
"""JSON bodies from this size on are decoded off the event loop (some 5 ms a megabyte)."""

PROTOCOLS = ("http", "grpc")
"""The doors a request comes through: the `protocol` label of the request metrics."""

request_duration = Histogram(
    "batchserve_request_duration_seconds", "Inference requests from arrival to answer",
    ["runner", "code", "protocol"], buckets=SECONDS_BUCKETS,
)
requests_total = Counter(
    "batchserve_requests_total", "Inference requests answered", ["runner", "code", "protocol"]
)
UNAVAILABLE_REASONS = ("queue", "backlog", "front", "draining", "expired", "unreachable",
                       "late", "pipeline")
FLOODS = frozenset(("backlog", "front", "pipeline"))
"""The 503s an API worker gives itself for overload, without a crossing: the ones that come
by the thousand a second, so they are written to the metrics in bulk (`Service.observe`)."""
unavailable_total = Counter(
    "batchserve_unavailable_total", "Inference requests answered 503, by why",
    ["runner", "reason", "protocol"],
)
inflight_requests = Gauge(
    "batchserve_inflight_requests", "Requests an API worker has sent to a runner, unanswered",
    ["runner"], multiprocess_mode="liveall",
)
processes_connected = Gauge(
    "batchserve_runner_processes_connected", "Runner processes an API worker is connected to",
    ["runner"], multiprocess_mode="liveall",
)
processes_configured = Gauge(
    "batchserve_runner_processes_configured", "Runner processes the configuration asks for",
    ["runner"], multiprocess_mode="liveall",
)
reserve_seconds = Gauge(
    "batchserve_api_reserve_seconds",
    "Time an API worker keeps back from a model's limit for its answers' way home: how late "
    "they would have left had their batches ended at their deadlines, lately (99th "
    "percentile), at most a quarter of the limit",
    ["runner"], multiprocess_mode="liveall",
)


class FrontCost:
    """This worker's CPU seconds per inference request answered, over the span since the
    last reading that saw enough requests to say (the worker's whole CPU: HTTP, decoding,
    dispatch, answers, and whatever else it does meanwhile)."""

    MIN_REQUESTS = 50

    def __init__(self, cpu_clock: Callable[[], float] = time.process_time) -> None:
        self._cpu_clock = cpu_clock
        self._cpu, self._answered = cpu_clock(), 0

    def measure(self, answered: int) -> float | None:
        if answered - self._answered < self.MIN_REQUESTS:
            return None
        cpu = self._cpu_clock()
        cost = (cpu - self._cpu) / (answered - self._answered)
        self._cpu, self._answered = cpu, answered
        return cost


def infer_target(path: str) -> tuple[str, str | None] | None:
    """The model and version of `/v2/models/{name}[/versions/{version}]/infer`, else None."""
    parts = path.split("/")
    if parts[-1] != "infer" or parts[1:3] != ["v2", "models"]:
        return None
    if len(parts) == 5:
        return parts[3], None
    if len(parts) == 7 and parts[4] == "versions":
        return parts[3], parts[5]
    return None


class Service:
    """The configuration and one pool per runner, with the inference path over them; a
    pipeline is served over its runners' pools (`batchserve.api.pipeline`)."""

    def __init__(self, config: Config, addresses: Mapping[str, Sequence[Address]],
                 keys: Credentials = NO_KEYS) -> None:
        self.config = config
        # Every model a client may name: the runners, and each pipeline as its facade.
        self.models: dict[str, RunnerConfig] = {
            **config.runners, **{name: p.facade for name, p in config.pipelines.items()}}
        self.pools = {
            name: Pool(name, addresses.get(name, ()), config.timeouts, keys,
                       choice=runner.choice, changed=self.publish)
            for name, runner in config.runners.items()
        }
        # The loop serves every runner, so it must keep up with the tightest limit.
        tightest_s = min(r.batching.max_latency_ms for r in config.runners.values()) / 1000
        self.shedder = Shedder(target_s=max(Timeouts.LAG_FLOOR_S, tightest_s / 10))
        self.inflight = 0  # requests accepted and not yet answered
        self.answered = 0  # inference requests answered, ever
        self._front = FrontCost()
        self.stopping = False
        self.arrived = asyncio.Event()  # set by every request: wakes the lag watch from idle
        self.waiting = dict.fromkeys(self.models, 0)  # calls out to each runner
        self.reserves = {name: Reserve() for name in self.models}
        self.decode_rates = {name: admission.DecodeRate() for name in self.models}
        self.gates = {name: Gate() for name in self.models}
        # The last front refusal of each runner and kind, with the words it was made for.
        self._refusals: dict[tuple[str, str], tuple[float, float, Overloaded]] = {}
        self.routes = {
            name: Route(pipeline, config.runners, self.pools, self.gates, self.waiting,
                        config.timeouts)
            for name, pipeline in config.pipelines.items()}
        # Answers are tallied here and written to the metrics in bulk (`flush`).
        self._answers: dict[tuple[str, int, str], Tally] = {}
        # Every reason's series exists from the start, so a rate over it reads 0, not nothing.
        self._unavailable = {
            (name, reason, door): Count(unavailable_total.labels(name, reason, door))
            for name in self.models for reason in UNAVAILABLE_REASONS for door in PROTOCOLS
        }
        # Those holding counts not yet written: a flush visits these, not all of the above
        # (a hundred on the bundled file), as it runs after every answer of an idle worker.
        self._unwritten: list[Tally | Count] = []
        # Called with every publish and at a stop: the gRPC door's health statuses.
        self.listeners: list[Callable[[], None]] = []
        self._decoder: ThreadPoolExecutor | None = None  # made for the first large JSON body

    @property
    def decoder(self) -> ThreadPoolExecutor:
        """The one thread that decodes large JSON bodies, one at a time."""
        if self._decoder is None:
            self._decoder = ThreadPoolExecutor(1, thread_name_prefix="batchserve-decode")
        return self._decoder

    def publish(self) -> None:
        """This worker's live gauges (calls in flight, runner processes connected, the time
        kept back for the way home), and the answers tallied since the last flush; what a
        request costs this worker lately, for the runners' capacity."""
        self.flush()
        front_s = self._front.measure(self.answered)
        if front_s is not None:
            for pool in self.pools.values():
                pool.front_s = front_s
        for name, pool in self.pools.items():
            inflight_requests.labels(name).set(self.waiting[name])
            processes_connected.labels(name).set(sum(link.connected for link in pool.links))
            processes_configured.labels(name).set(len(pool.links))
        for name, model in self.models.items():
            limit_s = model.batching.max_latency_ms / 1000
            reserve_seconds.labels(name).set(self.reserves[name].seconds(limit_s))
        for listener in self.listeners:
            listener()

    @property
    def busy(self) -> bool:
        """Whether requests are in flight, or the front still sheds some."""
        return self.inflight > 0 or self.shedding

    def stop(self) -> None:
        """Take no new work from now on: readiness and new inference requests answer 503."""
        self.stopping = True
        for listener in self.listeners:
            listener()

    @property
    def ready(self) -> bool:
        """Whether every runner has a process connected and the worker takes work."""
        return not self.stopping and all(pool.ready for pool in self.pools.values())

    def model_ready(self, name: str) -> bool:
        """Whether a process of runner `name` (a served one; for a pipeline, of each of its
        runners) is connected and the worker takes work."""
        route = self.routes.get(name)
        runners = route.pipeline.runners if route is not None else (name,)
        return not self.stopping and all(self.pools[runner].ready for runner in runners)

    @property
    def idle(self) -> bool:
        """Whether every accepted request has been answered."""
        return self.inflight == 0

    def abandon(self) -> None:
        """The grace period is over: answer every request still waiting on a runner 503."""
        error = Stopping("the server stopped before the runner answered; retry shortly")
        for pool in self.pools.values():
            pool.abandon(error)

    def runner(self, name: str, version: str | None = None) -> RunnerConfig:
        runner = self.models.get(name)
        if runner is None or version not in (None, VERSION):
            label = name if version is None else f"{name} version {version}"
            raise ModelNotFound(label, self.models)
        return runner

    def request(self, name: str, version: str | None, respond: Respond) -> Exchange:
        """Admit an inference request for model `name` whose headers have arrived: refused
        at once (answered, `done`) when the model is unknown, the worker stops or sheds; else
        waiting for its body (`Exchange.run`)."""
        return self.admit(Exchange(self, name, respond), version)

    def admit(self, exchange: ExchangeT, version: str | None) -> ExchangeT:
        """Admit an exchange of either door (see `request`)."""
        exchange.admit(version)
        return exchange

    def shed(self, runner: str) -> None:
        """Refuse before any work when this worker is behind, or its runner refuses what
        comes (see `batchserve.api.overload`). Only while other requests are in flight: with
        none there is no backlog to shed, so the first request after an overload is served
        whatever share the controllers still hold."""
        refusal = self.front_refusal(runner, self.inflight - 1)
        if refusal is not None:  # a new one: the kept one would keep this raise's frames
            raise Overloaded(refusal.why, refusal.retry_after, refusal.details)

    def refused_at_front(self, name: str, version: str | None) -> Overloaded | None:
        """`shed`'s refusal of a request for a served model whose headers just came, before
        anything is built for it, or None. A door writes it as it is: a worker that sheds
        turns most of what arrives away, and on a refusal that builds an exchange, raises
        and formats its words afresh, that Python costs as much as the socket's reads and
        writes (`front_refusal`)."""
        if name not in self.models or version not in (None, VERSION) or self.stopping:
            return None  # told what is wrong, or that the worker stops, by `admit`
        refusal = self.front_refusal(name, self.inflight)
        if refusal is not None:  # answered now, and counted as `finish` counts an answer
            self.answered += 1
            self.observe(name, 503, time.monotonic(), refusal.reason)
        return refusal

    def front_refusal(self, runner: str, others: int) -> Overloaded | None:
        """The refusal at the front of a request for `runner` while `others` requests are
        in flight in this worker, or None. The same object for as long as its words stay
        the same (the lag to a tenth of a millisecond, the Retry-After), so a door may keep
        what it wrote for it; never raised itself (`shed` raises a copy)."""
        if others >= self.config.api.max_inflight:
            return self._refusal(runner, "inflight", others, time.monotonic())
        if not others:
            return None
        shedder = self.shedder
        if shedder.share and not shedder.admits(random.random(), now := time.monotonic()):
            return self._refusal(runner, "lag", round(shedder.behind_s(now) * 1000, 1), now)
        gate = self.gates[runner]
        if (gate.share and self._calls_out(runner)
                and not gate.admits(random.random(), now := time.monotonic())):
            return self._refusal(runner, "gate", round(gate.share, 3), now)
        return None

    def _refusal(self, runner: str, kind: str, value: float, now: float) -> Overloaded:
        """The refusal of `kind` with its `value`: the one made last, if the words match."""
        retry_s = self.front_retry_s(runner, now)
        last = self._refusals.get((runner, kind))
        if last is not None and last[0] == value and last[1] == retry_s:
            return last[2]
        if kind == "inflight":
            refusal = Overloaded(f"{value:.0f} requests in flight in this API worker", retry_s,
                                 details={"inflight": value})
        elif kind == "lag":
            refusal = Overloaded(f"this API worker runs {value:.0f} ms behind", retry_s,
                                 details={"lag_ms": value})
        else:
            what = "pipeline" if runner in self.routes else "runner"
            refusal = Overloaded(f"{what} {runner!r} refuses {100 * value:.0f}% of what "
                                 "comes now", retry_s, details={"refused_share": value})
        self._refusals[runner, kind] = (value, retry_s, refusal)
        return refusal

    def _calls_out(self, name: str) -> int:
        """Calls this worker has out to a runner, or to any step's runner of a pipeline."""
        route = self.routes.get(name)
        if route is None:
            return self.waiting[name]
        return sum(self.waiting[step.runner] for step in route.pipeline.steps)

    def front_retry_s(self, runner: str, now: float) -> float:
        """Retry-After of a front shed: the backlog that the share this worker turns away
        now (for its lag or for the runner's refusals) adds up to (`overload.backlog_s`)."""
        shedder = self.shedder
        share = max(shedder.share, self.gates[runner].shares(now))
        return retry_after_s(backlog_s(share, shedder.behind_s(now)))

    def observe(self, runner: str, status: int, started: float, reason: str,
                door: str = "http") -> None:
        """Count one answer, and a 503 once more by its reason. A 200, and a 503 this worker
        gave for overload (`FLOODS`), is written to the metrics with the next flush (the
        worker falls idle, or `Timeouts.PUBLISH_S` passes): under overload they are most
        answers, and writing each at once (four multiprocess writes) would cost a refusal a
        fifth more. Any other answer is rare, and is written at once, so a scrape right after
        it counts it."""
        if runner not in self.models:  # a model not served here: nothing to count it under
            return
        tally = self._answers.get((runner, status, door))
        if tally is None:
            code = str(status)
            tally = self._answers[runner, status, door] = Tally(
                request_duration.labels(runner, code, door),
                requests_total.labels(runner, code, door))
        tally.observe(time.monotonic() - started)
        if status != 503:
            if status != 200:
                tally.flush()
            elif tally.count == 1:
                self._unwritten.append(tally)
            return
        count = self._unavailable.get((runner, reason, door))
        if count is None:  # a 503 raised without a reason of its own
            reason = reason or "unreachable"
            count = self._unavailable[runner, reason, door] = Count(
                unavailable_total.labels(runner, reason, door))
        count.inc()
        if reason not in FLOODS:
            tally.flush()
            count.flush()
            return
        self._unwritten += [held for held in (tally, count) if held.count == 1]

    @property
    def shedding(self) -> bool:
        """Whether the front turns requests away now (for its loop's lag or a runner's)."""
        if self.shedder.share > 0.0:
            return True
        now = time.monotonic()
        return any(gate.share and gate.shares(now) for gate in self.gates.values())

    def flush(self) -> None:
        """Write every answer tallied since the last flush to the metrics: whenever no request
        is in flight, and every `Timeouts.PUBLISH_S` while busy (`publish`)."""
        unwritten, self._unwritten = self._unwritten, []
        for held in unwritten:
            held.flush()


class Exchange:
    """One inference request, from its admission to its one answer; this class reads and
    writes HTTP's v2 bodies (`decode`, `encode`, `refusal`), the gRPC door's subclass the
    protocol buffers."""

    PROTOCOL = "http"

    __slots__ = ("service", "name", "respond", "started", "done", "counted", "runner",
                 "call", "sent", "budget_s", "chain")

    def __init__(self, service: Service, name: str, respond: Respond) -> None:
        self.service, self.name, self.respond = service, name, respond
        self.started = time.monotonic()
        self.done = False
        self.counted = False  # in `service.inflight`
        self.runner: RunnerConfig | None = None
        self.call: protocol.InferRequest | None = None
        self.sent = self.budget_s = 0.0
        self.chain: Chain | None = None  # a pipeline's request: its way through the steps

    def admit(self, version: str | None) -> None:
        service = self.service
        try:
            runner = self.runner = service.runner(self.name, version)
            if service.stopping:
                raise Stopping()
            service.inflight += 1
            self.counted = True
            service.arrived.set()
            service.shed(self.name)
            limit = runner.batching.max_latency_ms / 1000
            budget_s = limit - service.reserves[self.name].seconds(limit)
            route = service.routes.get(self.name)
            if route is not None:
                self.chain = route.chain(self)
                route.judge(budget_s, self.started, None)
                return
            self._refuse_on_backlog(service.pools[self.name].least_backlog(self.started),
                                    budget_s, self.started)
        except Exception as exc:
            self.fail(exc)

    def run(self, body: bytes, header_length: str | None) -> None:
        """Decode the body and send it to a runner process; answered when that answers."""
        runner = self.runner
        assert runner is not None and not self.done
        try:
            # The deadline runs from the whole request's arrival: its upload is the client's.
            arrived = time.monotonic()
            limit = runner.batching.max_latency_ms / 1000
            rate = self.decode_rate(runner, header_length)
            if rate is not None and (least_s := rate.least_s(len(body))) > limit:
                raise admission.too_large_on_arrival(
                    runner.name, len(body), least_s, runner.batching.max_latency_ms)
            if rate is not None and len(body) >= OFF_LOOP_BYTES:
                self._decode_off_loop(body, runner, rate, arrived)
                return
            # Only a large body's decoding is measured: a small one's is the fixed cost of any
            # request, which the reserve covers (and reading a thread's CPU clock is a system
            # call: two a request, for nothing).
            large = len(body) >= admission.LEARN_BYTES
            cpu = time.thread_time() if large else 0.0
            call = self.call = self.decode(body, header_length, runner)
            spent_s = time.thread_time() - cpu if large else 0.0
            self._send(call, len(body), spent_s, rate, arrived)
        except Exception as exc:
            self.fail(exc)

    def _decode_off_loop(self, body: bytes, runner: RunnerConfig,
                         rate: admission.DecodeRate, arrived: float) -> None:
        """Decode a large JSON body on the service's decoding thread; go on on the loop."""
        loop = asyncio.get_running_loop()

        def decode() -> None:  # on the decoding thread
            cpu = time.thread_time()
            try:
                outcome: protocol.InferRequest | Exception = self.decode(body, None, runner)
            except Exception as exc:
                outcome = exc
            spent_s = time.thread_time() - cpu
            loop.call_soon_threadsafe(self._decoded, outcome, len(body), spent_s, rate, arrived)

        self.service.decoder.submit(decode)

    def _decoded(self, outcome: protocol.InferRequest | Exception, size: int, spent_s: float,
                 rate: admission.DecodeRate, arrived: float) -> None:
        """Back on the loop with a body decoded off it."""
        if self.done:
            return
        try:
            if isinstance(outcome, Exception):
                raise outcome
            self.call = outcome
            self._send(outcome, size, spent_s, rate, arrived)
        except Exception as exc:
            self.fail(exc)

    def _send(self, call: protocol.InferRequest, size: int, spent_s: float,
              rate: admission.DecodeRate | None, arrived: float) -> None:
        """Judge a decoded request on its budget and send it to a runner process."""
        service, runner = self.service, self.runner
        assert runner is not None
        if size >= admission.LEARN_BYTES:
            self._judge_decoding(call, size, spent_s, rate)
        else:
            spent_s = 0.0
        limit = runner.batching.max_latency_ms / 1000
        if call.timeout_s is not None:
            limit = min(limit, call.timeout_s)
        self.sent = time.monotonic()
        self.budget_s = (limit - (self.sent - arrived)
                         - service.reserves[runner.name].seconds(limit))
        if self.budget_s <= 0:
            raise Unavailable(
                f"the request's deadline passed before it reached {runner.name!r}",
                reason="late")
        if self.chain is not None:
            self.chain.start(call.inputs, call.rows, self.sent + self.budget_s, call.group,
                             due=arrived + limit)
            return
        pool = service.pools[runner.name]
        link = pool.pick()
        self._refuse_on_backlog(link.backlog, self.budget_s, self.sent)
        # A runner answers by the call's deadline, or by its batch time limit once the
        # call is in a batch; the slack only bounds a runner process that hangs as a whole.
        wait_s = runner.batch_timeout_s + service.config.timeouts.call_slack_s
        pool.submit(call.inputs, call.rows, self.budget_s, call.group, wait_s, self.answered,
                    spent_s, link)
        service.waiting[runner.name] += 1

    def decode_rate(self, runner: RunnerConfig, header_length: str | None
                    ) -> admission.DecodeRate | None:
        """The rate this worker decodes the runner's JSON bodies at; None for a binary one."""
        return self.service.decode_rates[runner.name] if header_length is None else None

    def decode(self, body: bytes, header_length: str | None, runner: RunnerConfig
               ) -> protocol.InferRequest:
        return protocol.decode_infer(body, protocol.parse_header_length(header_length), runner)

    def encode(self, runner: RunnerConfig, call: protocol.InferRequest, outputs: Tensors
               ) -> tuple[bytes, Mapping[str, str]]:
        return protocol.encode_infer(runner.name, call, outputs, runner)

    def refusal(self, exc: BaseException) -> tuple[int, bytes, Mapping[str, str]]:
        """An error's status, body and headers."""
        return error_response(exc)

    def _refuse_on_backlog(self, backlog: Published | None, budget_s: float, now: float
                           ) -> None:
        """Refuse in place what a runner process would refuse, by the backlog it published
        (`batchserve.api.backlog`): no crossing, and on its headers when every process would."""
        if backlog is None or not backlog.refuses(budget_s, now):
            return
        left_s = backlog.left_s(now)
        rows = self.call.rows if self.call is not None else backlog.word.request_rows
        raise BacklogRefused(self.name, retry_after_s(backlog.refuse(rows)), {
            "predicted_ms": round(left_s * 1000, 1), "deadline_ms": round(budget_s * 1000, 1),
            "rows_ahead": backlog.word.rows_ahead})

    def _judge_decoding(self, call: protocol.InferRequest, size: int, spent_s: float,
                        rate: admission.DecodeRate | None) -> None:
        """Learn the decoding rate of a large JSON body; refuse a request whose decoding
        alone took more CPU than the runner's limit (see `batchserve.api.admission`)."""
        runner = self.runner
        assert runner is not None
        if rate is not None:
            rate.observe(size, spent_s)
        limit_ms = runner.batching.max_latency_ms
        if spent_s * 1000 > limit_ms:
            unit = "rows" if runner.layout == "rows" else "elements"
            raise admission.too_slow_to_decode(
                runner.name, protocol.cost(call, runner), unit, spent_s, limit_ms,
                binary=rate is None)

    def answered(self, outcome: Tensors | Exception, spare_s: float) -> None:
        """The runner's answer (or why there is none): encode it and answer the client."""
        service, runner, call = self.service, self.runner, self.call
        assert runner is not None and call is not None
        try:
            outputs = outputs_of(runner.name, outcome, service.waiting,
                                 service.gates[runner.name])
        except Exception as exc:
            self.fail(exc)
            return
        self.deliver(outputs, call.rows, spare_s)

    def deliver(self, outputs: Tensors, rows: int, spare_s: float) -> None:
        """Encode the outputs, `rows` of them along the output batch dimension (a pipeline's
        are its last step's), and answer the client; `spare_s` is how long before its
        deadline the runner's batch ended (`batchserve.api.reserve`)."""
        service, runner, call = self.service, self.runner, self.call
        assert runner is not None and call is not None
        try:
            if rows != call.rows:
                call = self.call = replace(call, rows=rows)
            content, headers = self.encode(runner, call, outputs)
            overrun_s = time.monotonic() - (self.sent + self.budget_s)
            service.reserves[runner.name].answered(overrun_s, spare_s)
        except Exception as exc:
            self.fail(exc)
            return
        self.finish(200, content, headers, "")

    def fail(self, exc: BaseException) -> None:
        if not isinstance(exc, BatchserveError):
            log.error("unexpected error answering a request", exc_info=exc)
        status, content, headers = self.refusal(exc)
        self.finish(status, content, headers, getattr(exc, "reason", ""))

    def finish(self, status: int, content: bytes, headers: Mapping[str, str], reason: str
               ) -> None:
        if self.done:
            return
        self.done = True
        service = self.service
        service.answered += 1
        if self.counted:
            service.inflight -= 1
        try:
            self.respond(status, content, headers)
        except Exception:
            log.exception("writing an answer failed")
        service.observe(self.name, status, self.started, reason, self.PROTOCOL)
        if service.inflight == 0:
            service.flush()
