"""Runners found by DNS (`dns+tcp:name:port`): a pool's processes follow the name's answers.

The resolver is injected, so each test says what the name resolves to; the processes are
small runners on this event loop, each on its own loopback address (127.0.0.2, 127.0.0.3:
all of 127/8 reaches this host on Linux) and one shared port, as pods behind one Service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml

from batchserve.api.discovery import resolve
from batchserve.api.dispatch import Link, Pool
from batchserve.runner import server as runner_server
from batchserve.runner.core.config import ConfigError, parse
from batchserve.runner.core.handshake import admit, opening
from batchserve.runner.core.security import Credentials
from batchserve.runner.core.timeouts import Timeouts
from batchserve.runner.core.wire import (
    Address,
    Call,
    FrameReader,
    Ping,
    Pong,
    Result,
    decode,
    encode,
)
from tests.conftest import ROOT, Server, start_server, wait_for
from tests.test_remote import TOKEN, start_runner, stop_runner

KEYS = Credentials(insecure=True)
NAME = "runners.example"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class FakeRunner:
    """A runner process as far as a link can tell: the handshake, pongs, and calls answered
    with their own tensors once `release` is set."""

    ip: str
    release: asyncio.Event = field(default_factory=asyncio.Event)
    calls: int = 0
    connections: int = 0
    closed: int = 0  # connections the API end closed

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = opening("m", 8)
        writer.writelines(encode(first))
        frames = FrameReader()
        answered = False
        while data := await reader.read(1 << 16):
            for body in frames.feed(data):
                message = decode(body)
                if not answered:
                    writer.writelines(encode(admit(first, message, None)))  # type: ignore[arg-type]
                    answered = True
                elif isinstance(message, Ping):
                    writer.writelines(encode(Pong(message.id)))
                elif isinstance(message, Call):
                    self.calls += 1
                    asyncio.create_task(self.answer(writer, message))
        self.closed += 1
        writer.close()

    async def answer(self, writer: asyncio.StreamWriter, call: Call) -> None:
        await self.release.wait()
        if not writer.is_closing():
            writer.writelines(encode(Result(call.id, dict(call.tensors), 0.0)))


class FakeDNS:
    """The injected resolver: answers what the test set, and counts the questions."""

    def __init__(self) -> None:
        self.answer: Sequence[str] | OSError = []
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append(host)
        if isinstance(self.answer, OSError):
            raise self.answer
        return self.answer


@dataclass
class Cluster:
    runners: dict[str, FakeRunner]
    port: int
    dns: FakeDNS

    def pool(self, timeouts: Timeouts) -> Pool:
        return Pool("m", [Address.parse(f"dns+tcp:{NAME}:{self.port}")], timeouts, KEYS,
                    self.dns)


async def _listen(ips: Sequence[str]) -> tuple[list[asyncio.Server], dict[str, FakeRunner], int]:
    """One fake runner per IP, all on one port (the first IP's free port)."""
    runners = {ip: FakeRunner(ip) for ip in ips}
    first = await asyncio.start_server(runners[ips[0]].serve, ips[0], 0)
    port = first.sockets[0].getsockname()[1]
    servers = [first]
    try:
        for ip in ips[1:]:
            servers.append(await asyncio.start_server(runners[ip].serve, ip, port))
    except OSError:
        for server in servers:
            server.close()
        raise
    return servers, runners, port


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    for _ in range(5):  # the first port may be taken on another address: try another
        with contextlib.suppress(OSError):
            servers, runners, port = await _listen(["127.0.0.2", "127.0.0.3"])
            break
    else:
        pytest.fail("no port free on both 127.0.0.2 and 127.0.0.3")
    yield Cluster(runners, port, FakeDNS())
    for server in servers:
        server.close()
        await server.wait_closed()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll the event loop until `condition` holds; fail after 10 s. (A poll, not an event:
    the conditions span links, runners and the resolver, and none of them signals.)"""
    try:
        async with asyncio.timeout(10):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"not within 10 s: {what}")


def connected(pool: Pool) -> set[str]:
    return {link.address.host for link in pool.links if link.connected}


def hosts(pool: Pool) -> set[str]:
    return {link.address.host for link in pool.links}


QUIET = Timeouts(resolve_s=3600)  # only the test (or a connection error) asks DNS again


@pytest.mark.anyio
async def test_processes_come_and_go_with_the_names_answers(cluster: Cluster) -> None:
    dns = cluster.dns
    dns.answer = ["127.0.0.2"]
    pool = cluster.pool(QUIET)
    pool.start()
    try:
        await until(lambda: connected(pool) == {"127.0.0.2"}, "connected to 127.0.0.2")
        dns.answer = ["127.0.0.2", "127.0.0.3"]
        pool.names[0].again()
        await until(lambda: connected(pool) == {"127.0.0.2", "127.0.0.3"}, "both connected")
        first = next(link for link in pool.links if link.address.host == "127.0.0.2")
        dns.answer = ["127.0.0.3"]
        pool.names[0].again()
        await until(lambda: hosts(pool) == {"127.0.0.3"}, "127.0.0.2 dropped")
        await until(lambda: cluster.runners["127.0.0.2"].closed == 1, "its connection closed")
        assert not first.connected
        assert {pool.pick().address.host for _ in range(20)} == {"127.0.0.3"}
    finally:
        await pool.close()
    assert cluster.runners["127.0.0.2"].connections == 1  # never reconnected once dropped


@pytest.mark.anyio
async def test_periodic_resolution_finds_a_new_process(cluster: Cluster) -> None:
    dns = cluster.dns
    dns.answer = ["127.0.0.2"]
    pool = cluster.pool(Timeouts(resolve_s=0.05))
    pool.start()
    try:
        await until(lambda: connected(pool) == {"127.0.0.2"}, "connected to 127.0.0.2")
        dns.answer = ["127.0.0.2", "127.0.0.3"]  # nobody wakes the pool: its period does
        await until(lambda: connected(pool) == {"127.0.0.2", "127.0.0.3"}, "both connected")
    finally:
        await pool.close()


@pytest.mark.anyio
async def test_a_failed_resolution_keeps_the_processes(
    cluster: Cluster, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "batchserve.api.discovery")
    dns = cluster.dns
    dns.answer = ["127.0.0.2", "127.0.0.3"]
    pool = cluster.pool(QUIET)
    pool.start()
    try:
        await until(lambda: len(connected(pool)) == 2, "both connected")
        links = list(pool.links)
        dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        for asked in (2, 3):
            pool.names[0].again()
            await until(lambda: len(dns.asked) == asked, f"question {asked}")  # noqa: B023
        await asyncio.sleep(0)  # the answer (a failure) is handled in the same step
        assert pool.links == links and connected(pool) == {"127.0.0.2", "127.0.0.3"}
        dns.answer = ["127.0.0.3"]
        pool.names[0].again()
        await until(lambda: hosts(pool) == {"127.0.0.3"}, "127.0.0.2 dropped")
    finally:
        await pool.close()
    port = cluster.port
    assert caplog.messages == [  # one warning for two failures
        f"runner m: dns+tcp:{NAME}:{port} does not resolve ([Errno -2] Name or service not "
        "known); keeping the processes it had",
        f"runner m: dns+tcp:{NAME}:{port} resolves again",
    ]


@pytest.mark.anyio
async def test_a_connection_error_resolves_the_name_again(cluster: Cluster) -> None:
    """127.0.0.4 has no runner (a pod that left): failing to connect asks DNS again, and the
    new answer drops it, long before the hour-long period would."""
    dns = cluster.dns
    dns.answer = ["127.0.0.2", "127.0.0.4"]
    pool = cluster.pool(QUIET)
    pool.start()
    try:
        await until(lambda: len(dns.asked) >= 2, "a second question after a connection error")
        dns.answer = ["127.0.0.2"]
        await until(lambda: hosts(pool) == {"127.0.0.2"}, "127.0.0.4 dropped")
        assert connected(pool) == {"127.0.0.2"}
    finally:
        await pool.close()


@pytest.mark.anyio
async def test_a_process_that_leaves_answers_its_calls_in_flight_first(cluster: Cluster) -> None:
    dns = cluster.dns
    dns.answer = ["127.0.0.2"]
    pool = cluster.pool(QUIET)
    pool.start()
    leaving = cluster.runners["127.0.0.2"]
    try:
        await until(lambda: connected(pool) == {"127.0.0.2"}, "connected to 127.0.0.2")
        rows = {"x": np.arange(4, dtype=np.float32).reshape(1, 4)}
        call = asyncio.create_task(pool.infer(rows, 1, 5.0))
        await until(lambda: leaving.calls == 1, "the call reached 127.0.0.2")
        link: Link = pool.links[0]
        dns.answer = ["127.0.0.3"]
        pool.names[0].again()
        await until(lambda: hosts(pool) == {"127.0.0.3"}, "127.0.0.2 out of the choice")
        assert link.connected and not call.done()  # still waiting for its answer
        leaving.release.set()
        answer = await call
        np.testing.assert_array_equal(answer["x"], rows["x"])
        await until(lambda: leaving.closed == 1, "127.0.0.2's connection closed after")
    finally:
        await pool.close()


@pytest.mark.anyio
async def test_the_system_resolver_reads_the_hosts_file() -> None:
    assert "127.0.0.1" in await resolve("localhost", 7000)


# --- addresses and configuration -------------------------------------------------------------


def test_a_dns_address_names_a_port_and_gives_tcp_addresses() -> None:
    name = Address.parse("dns+tcp:batchserve-runner-mlp:7000")
    assert (name.discovered, name.tcp, name.host, name.port) == (
        True, True, "batchserve-runner-mlp", 7000)
    assert str(name.at("10.1.2.3")) == "tcp:10.1.2.3:7000"
    assert not Address.parse("tcp:10.1.2.3:7000").discovered
    for bad in ("dns+tcp:batchserve-runner-mlp", "dns+tcp::7000", "dns+tcp:x:70000"):
        with pytest.raises(ValueError, match="must look like dns\\+tcp:host:port"):
            Address.parse(bad)


RUNNER = {"model": "m:f", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
          "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}


def test_the_configuration_takes_dns_addresses_and_a_resolve_period() -> None:
    config = parse({"runners": {"m": {**RUNNER, "addresses": ["dns+tcp:runners:7000"]}},
                   "timeouts": {"resolve_s": 2}})
    assert config.runners["m"].addresses == (Address("dns+tcp", "runners:7000"),)
    assert config.timeouts.resolve_s == 2
    with pytest.raises(ConfigError, match=r"^runners.m.addresses\[0\] has value 'dns:runners:"
                       r"7000'; it must be an address unix:/path, tcp:host:port or "
                       r"dns\+tcp:name:port$"):
        parse({"runners": {"m": {**RUNNER, "addresses": ["dns:runners:7000"]}}})
    with pytest.raises(ConfigError, match="^timeouts.resolve_s has value 0; it must be a "
                       "positive number$"):
        parse({"runners": {"m": RUNNER}, "timeouts": {"resolve_s": 0}})


def test_a_dns_address_needs_a_token_like_tcp() -> None:
    with pytest.raises(ConfigError, match="dns\\+tcp:runners:7000 is a TCP address but no "
                       "token is set"):
        Credentials().check(Address.parse("dns+tcp:runners:7000"))


def test_a_runner_cannot_listen_on_a_dns_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "configuration.yml"
    config.write_text(yaml.safe_dump({"runners": {"m": RUNNER}}))
    assert runner_server.main(["--config", str(config), "--runner", "m",
                        "--listen", "dns+tcp:runners:7000"]) == 3
    assert capsys.readouterr().err == (
        "error: --listen dns+tcp:runners:7000: a runner listens on tcp:host:port or "
        "unix:/path (dns+tcp: is for finding runners)\n")


# --- real processes ----------------------------------------------------------------------------

PIDS = """
transport: {{token_file: token}}
runners:
  pids:
    model: fixture_models:pid_echo
    {addresses}
    batching: {{max_batch_size: 8, max_latency_ms: 1000}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: echo, datatype: FP32, shape: [-1, 4]}},
              {{name: pid, datatype: INT64, shape: [-1, 1]}}]
"""


def test_an_api_only_front_reaches_runners_by_address_and_by_name(tmp_path: Path) -> None:
    """Two `batchserve runner` processes: one on 127.0.0.2 listed as a `tcp:` address, one on
    127.0.0.1 found through the name `localhost` (the hosts file, resolved by the API worker
    as it would resolve a headless Service). Requests reach both."""
    shutil.copy(ROOT / "tests" / "fixture_models.py", tmp_path / "fixture_models.py")
    (tmp_path / "token").write_text(TOKEN + "\n")
    config = tmp_path / "runner.yml"
    config.write_text(PIDS.format(addresses=""))
    runners = [start_runner(config, "pids", f"tcp:{ip}:0") for ip in ("127.0.0.2", "127.0.0.1")]
    front: Server | None = None
    try:
        by_ip, by_name = runners[0].address, runners[1].address.replace("tcp:127.0.0.1:",
                                                                          "dns+tcp:localhost:")
        (tmp_path / "front.yml").write_text(PIDS.format(
            addresses=f"addresses: [{by_ip}, {by_name}]"))
        front = start_server(tmp_path / "front.yml", "--api-only", "--api-workers", "1")
        seen: set[int] = set()

        def both_served() -> bool:
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                "data": [1, 2, 3, 4]}]}
            with front.client() as client:  # type: ignore[union-attr]
                answer = client.post("/v2/models/pids/infer", json=body)
            if answer.status_code == 200:
                outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
                assert outputs["echo"] == [1, 2, 3, 4]
                seen.add(outputs["pid"][0])
            return len(seen) == 2

        wait_for(both_served, 60, "requests served by both runners")
        assert seen == {runner.process.pid for runner in runners}
        assert any(f"dns+tcp:localhost:{by_name.rsplit(':', 1)[1]} has 1 process(es): "
                   f"{runners[1].address}" in line for line in front.log), "".join(front.log)
    finally:
        if front is not None:
            assert front.stop() == 0, "".join(front.log)
        for runner in runners:
            assert stop_runner(runner) == 0, "".join(runner.log)
