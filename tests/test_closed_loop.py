"""Closed-loop clients on the bundled `mlp` are not refused.

Each client is a thread with its own `tritonclient.http` client that sends one row, waits
for the answer and sends the next, for a fixed time. Every answer is counted by status and
must match what the server itself counted. 8 and 32 clients alone must be answered 200
every time. Beside a process spinning on one core (a neighbour taking a core the server
counted on) they may be refused at most 2%, and 64 clients, whose threads leave the server
little of the machine, at most 0.5%: what a slow spell of the host costs, not a bias of the
policy. Load tests on a shared machine: run the suite under the bench lock
(`flock /tmp/batchserve-bench.lock`).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from batchserve.api.bench.scrape import Scrape, delta, fetch
from tests.conftest import ROOT, Server

SECONDS = 10.0


@dataclass
class Tally:
    """What the closed-loop clients got back: answers by status, and their latencies."""

    statuses: Counter[int | str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, status: int | str, latency: float) -> None:
        with self.lock:
            self.statuses[status] += 1
            self.latencies.append(latency)

    def summary(self) -> str:
        ms = sorted(lat * 1e3 for lat in self.latencies) or [0.0]
        p50, p99 = ms[len(ms) // 2], ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        return f"{dict(self.statuses)}, p50 {p50:.1f} ms, p99 {p99:.1f} ms"


def status_of(error: InferenceServerException) -> int | str:
    """The HTTP status tritonclient saw, or the error's text when there was no answer."""
    status = error.status()
    return int(status) if status and str(status).isdigit() else str(error)[:80]


def client_loop(url: str, seed: int, seconds: float, tally: Tally) -> None:
    client = triton.InferenceServerClient(url, connection_timeout=10, network_timeout=10)
    row = np.random.default_rng(seed).standard_normal((1, 256)).astype(np.float32)
    tensor = triton.InferInput("x", [1, 256], "FP32")
    tensor.set_data_from_numpy(row, binary_data=False)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.monotonic()
            try:
                client.infer("mlp", [tensor])
                status: int | str = 200
            except InferenceServerException as error:
                status = status_of(error)
            except Exception as error:  # a broken connection is an answer we count too
                status = type(error).__name__
            tally.add(status, time.monotonic() - start)
    finally:
        client.close()


def closed_loop(
    server: Server, clients: int, seconds: float
) -> tuple[Tally, dict[str, float], dict[str, float]]:
    """Run ``clients`` closed-loop threads; return their tally, the server's own counts by
    status, and its 503s by reason."""
    tally = Tally()
    url = server.url.removeprefix("http://")
    threads = [
        threading.Thread(target=client_loop, args=(url, i, seconds, tally), daemon=True)
        for i in range(clients)
    ]
    before = fetch(server.url)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    assert not any(t.is_alive() for t in threads), "a client hung past its network timeout"
    after = settled(server, before, sum(tally.statuses.values()))
    return tally, server_counts(before, after), refusal_reasons(before, after)


def settled(server: Server, before: Scrape, answers: int) -> Scrape:
    """The first reading whose counts cover ``answers`` (or the one after 5 s).

    A worker counts an answer just after sending it, so the last few may not be in the
    first reading after the clients stop.
    """
    deadline = time.monotonic() + 5.0
    while True:
        try:
            after = fetch(server.url)
        except OSError as error:
            raise AssertionError("".join(server.log[-20:])) from error
        if sum(server_counts(before, after).values()) >= answers or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def refusal_reasons(before: Scrape, after: Scrape) -> dict[str, float]:
    """The 503s the server answered for `mlp` between two readings, by why (the reason says
    which part refused: the runner's policy, the front's shedding, a runner out of reach)."""
    name = "batchserve_unavailable_total"
    found = delta(before.by_label(name, "reason", runner="mlp"),
                  after.by_label(name, "reason", runner="mlp"))
    return {reason: count for reason, count in found.items() if count}


def server_counts(before: Scrape, after: Scrape) -> dict[str, float]:
    """Answers the server counted for `mlp` between two readings, by status code."""
    name = "batchserve_requests_total"
    return delta(before.by_label(name, "code", runner="mlp"),
                 after.by_label(name, "code", runner="mlp"))


@contextlib.contextmanager
def cpu_hog(on: bool) -> Iterator[None]:
    """A process that spins on one core for as long as it runs, if `on`: a neighbour that
    takes a core the server counted on (the clients take the other)."""
    if not on:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


SLOW_SPELL_SHARE = 0.005
"""The most of 64 clients' requests that may be refused. Their threads and the server share
the two cores: on a quiet machine none is refused, but in a slow spell of the host the
runner reads requests tens of ms after they came and its batches overrun their line, and
the reserve for that tail refuses a few hundredths of a percent. A bias in the policy
refuses more: promises taken at four times the spreads refused 2.0% of them."""

NEIGHBOUR_SHARE = 0.02
"""The most of 8 or 32 clients' requests that may be refused beside the spinning process.
On a quiet host none is; on a slower one the neighbour stretches every batch and every
answer's way home, the reserves the server keeps for them grow toward the limit, and it
refuses what it would otherwise serve near its edge: 0.74% of 32 clients, served at p99
80 ms. A bias refuses far more: promises taken at ten times the spreads refused 55%."""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("clients", "hog", "most_refused"), [
    (8, False, 0.0), (32, False, 0.0), (8, True, NEIGHBOUR_SHARE), (32, True, NEIGHBOUR_SHARE),
    (64, False, SLOW_SPELL_SHARE),
], ids=["8", "32", "8-beside-a-cpu-hog", "32-beside-a-cpu-hog", "64"])
def test_closed_loop_clients_are_not_refused(
        bundled: Server, clients: int, hog: bool, most_refused: float) -> None:
    """Every answer is a 200, or a 503 within `most_refused` of them, and the server counted
    each of them."""
    with cpu_hog(hog):
        tally, on_server, reasons = closed_loop(bundled, clients, SECONDS)
    answers = sum(tally.statuses.values())
    why = f"{tally.summary()}; 503s by reason {reasons}; server log: {''.join(bundled.log[-20:])}"
    assert answers >= clients * 10, why  # each client got well past its first
    assert set(tally.statuses) <= {200, 503}, why
    assert tally.statuses[503] <= most_refused * answers, why
    assert on_server == {str(code): n for code, n in tally.statuses.items()}, (on_server, why)


TIGHT = (ROOT / "configuration.yml").read_text().replace("max_latency_ms: 100", "max_latency_ms: 3")


@pytest.mark.timeout(90)
def test_the_closed_loop_counts_every_refusal(serve: object) -> None:
    """On a limit the MLP cannot meet under load, the refusals are counted one by one."""
    server: Server = serve(TIGHT)  # type: ignore[operator]
    tally, on_server, reasons = closed_loop(server, 32, 2.0)
    assert sum(reasons.values()) == tally.statuses[503], (reasons, tally.summary())
    assert reasons["queue"] > 0, reasons  # the runner's own policy refuses, early
    assert tally.statuses[503] > 0, tally.summary()
    assert set(tally.statuses) == {200, 503}, tally.summary()
    assert on_server == {str(k): v for k, v in tally.statuses.items()}, tally.summary()
