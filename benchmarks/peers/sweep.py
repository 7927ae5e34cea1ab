"""The measuring run: every server fresh, warmed up, then each rate with the same client.

Rounds alternate the servers' order (forward, then reversed), so a drift of the shared machine
over the session hits all of them alike. Server CPU is that of every process in the
server's session, read from ``/proc`` around each rate (see
``batchserve.api.bench.cpu.server_cpu``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from batchserve.api.bench.cpu import cpu_between, run_queue_s, server_cpu
from batchserve.api.bench.load_result import LoadResult
from batchserve.api.bench.loadgen import run_load
from benchmarks.peers.launch import started
from benchmarks.peers.peer import Peer
from benchmarks.peers.recovery import AfterLoad
from benchmarks.peers.shared_client import run_shared

PASS_P99_MS = 100.0
PASS_NON_OK = 0.01
HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Run:
    """One server, one round, one rate: what the client saw and what the server burnt."""

    server: str
    round: int
    rate: float
    load: LoadResult
    cpu_s: float
    processes: int
    wait_s: float = 0.0
    """Seconds the server's threads were runnable but waited for a core: on a busy machine,
    how much of the server's time the scheduler gave to others."""
    recovery_s: float | None = None
    """After the last send, how long until a lone request got a 200 again."""

    @property
    def passed(self) -> bool:
        p99 = self.load.ok_p99_ms
        return p99 is not None and p99 <= PASS_P99_MS and self.load.errors < PASS_NON_OK

    @property
    def cpu_ms_per_req(self) -> float:
        return self.cpu_s * 1e3 / self.load.sent if self.load.sent else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"server": self.server, "round": self.round, "rate": self.rate,
                "passed": self.passed, "cpu_s": self.cpu_s,
                "cpu_ms_per_req": self.cpu_ms_per_req, "processes": self.processes,
                "wait_s": self.wait_s, "recovery_s": self.recovery_s,
                "load": self.load.as_dict()}


@dataclass(frozen=True)
class Idle:
    """One server, one round, no traffic: the CPU its whole process tree burnt meanwhile."""

    server: str
    round: int
    seconds: float
    cpu_s: float

    @property
    def share(self) -> float:
        """Of one core."""
        return self.cpu_s / self.seconds


@dataclass(frozen=True)
class Settings:
    seconds: float
    warmup_rate: float
    warmup_seconds: float
    drain_s: float
    logs: Path
    shared: bool = False
    """Load with the shared clients (``shared_client``) rather than batchserve's own."""
    idle_s: float = 0.0
    """Seconds of no traffic to measure after the warm-up (0: none)."""


def order(peers: Sequence[Peer], round_: int) -> list[Peer]:
    return list(peers) if round_ % 2 == 0 else list(reversed(peers))


def load_once(runner: asyncio.Runner, settings: Settings, url: str, body: bytes, rate: float,
              seconds: float, seed: int) -> LoadResult:
    """One open-loop run with the client ``settings`` name."""
    if settings.shared:
        return run_shared(url, body, rate, seconds, seed, settings.drain_s)
    return runner.run(run_load(url, body, HEADERS, rate, seconds, seed=seed,
                               drain_timeout=settings.drain_s))


def idle(peer: Peer, pid: int, round_: int, seconds: float) -> Idle:
    """The server's CPU over ``seconds`` of no traffic, after a few to settle."""
    time.sleep(min(5.0, seconds))
    before = server_cpu(pid)
    time.sleep(seconds)
    cpu = cpu_between(before, server_cpu(pid))
    print(f"    idle: {100 * cpu.seconds / seconds:.2f}% of a core", flush=True)
    return Idle(peer.name, round_, seconds, cpu.seconds)


def one_server(
    runner: asyncio.Runner, peer: Peer, row: list[float], expected: list[float],
    rates: Sequence[float], round_: int, settings: Settings, idles: list[Idle] | None = None,
) -> list[Run]:
    """Start ``peer`` fresh, warm it up, measure it idle, then run each rate in turn on it."""
    body = orjson.dumps(peer.body(row))
    log = settings.logs / f"{peer.name}.log"
    runs = []
    with started(peer, body, expected, log) as server:
        print(f"  {peer.name}: answering after {server.startup_s:.1f} s", flush=True)
        load_once(runner, settings, server.url, body, settings.warmup_rate,
                  settings.warmup_seconds, round_ + 1000)
        if settings.idle_s > 0 and idles is not None:
            idles.append(idle(peer, server.pid, round_, settings.idle_s))
        for rate in rates:
            before = server_cpu(server.pid)
            waited = {key: run_queue_s(key[0]) for key in before}
            probe = AfterLoad(server.url, body, settings.seconds)
            load = load_once(runner, settings, server.url, body, rate, settings.seconds, round_)
            after = server_cpu(server.pid)
            cpu = cpu_between(before, after)
            wait_s = sum(run_queue_s(key[0]) - waited[key] for key in before.keys() & after.keys())
            back = probe.join()
            runs.append(Run(peer.name, round_, rate, load, cpu.seconds, cpu.processes, wait_s,
                            back))
            print(f"    {rate:6g} req/s: ok {load.ok}/{load.sent}, p99 {load.ok_p99_ms or 0:.1f}"
                  f" ms, goodput {load.goodput:.0f}/s, 503 p99 {load.refused_p99_ms or 0:.1f}"
                  f" ms, send lag p99 {load.timer_lag_p99_ms or 0:.1f} ms, cpu "
                  f"{runs[-1].cpu_ms_per_req:.2f} ms/req, waited for a core "
                  f"{wait_s / max(cpu.seconds, 1e-9):.1f}x as long"
                  f"{client_limit(load, settings.shared)}"
                  f"{'' if runs[-1].passed else '  (fails)'}", flush=True)
    return runs


def client_limit(load: LoadResult, shared: bool) -> str:
    """Say so when the client held requests back: with all its connections busy, requests
    wait in it (ours) or are not sent (the shared clients), unseen by the server, which can
    neither serve nor refuse them; their wait counts in latency. Ours also queues a few
    requests while its pool grows at a rate's start, which is no limit: it counts only past
    one request waiting per connection."""
    backlog, connections = load.peak_queued, load.peak_connections
    if backlog <= (0 if shared else connections):
        return ""
    held = f"{backlog} requests not sent" if shared else f"up to {backlog} requests waiting"
    return f", all {connections} connections busy ({held} in the client)"


def rounds(
    runner: asyncio.Runner, peers: Sequence[Peer], row: list[float], expected: list[float],
    rates_of: Callable[[Peer], Sequence[float]], count: int, settings: Settings,
    failures: dict[str, str], idles: list[Idle] | None = None,
) -> list[Run]:
    """``count`` rounds over ``peers`` (order alternating); a peer without rates is skipped.

    A server that does not start or answers wrongly is noted in ``failures`` and the sweep
    goes on with the others.
    """
    runs: list[Run] = []
    for round_ in range(count):
        began = time.monotonic()
        for peer in order(peers, round_):
            if not (rates := rates_of(peer)):
                continue
            try:
                runs += one_server(runner, peer, row, expected, rates, round_, settings, idles)
            except (RuntimeError, OSError) as exc:
                failures[peer.name] = f"round {round_ + 1}: {exc}"
                print(f"  {peer.name}: {exc}", flush=True)
        print(f"  round {round_ + 1} took {time.monotonic() - began:.0f} s", flush=True)
    return runs
