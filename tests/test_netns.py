"""Runners on hosts of their own: each `batchserve runner` in a network namespace, the API
tier (`serve --api-only`) in another, all cabled to one bridge (`tests.netns`), and the
runners found by name through the API host's hosts file, as through a headless Service.

The tests run in order on one cluster: traffic reaches every runner; a runner added to the
hosts file joins; a partitioned host is dropped while every request gets one answer; a
drained runner loses nothing; and the guards hold across the network: no token, no
connection; TLS without a client certificate, no connection. Skipped where namespaces
cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from batchserve.runner.core.handshake import Refused, greet
from batchserve.runner.core.wire import FrameSocket
from tests.conftest import ROOT, Server, start_server, wait_for
from tests.netns import Host, Lookups, Network, unavailable
from tests.test_remote import TOKEN, Runner, make_certificates, metric, start_runner, stop_runner

RESOLVE_S = 1.0
NAME = "runners.bs"
PORT = 7000
TIMEOUTS = (f"timeouts: {{resolve_s: {RESOLVE_S:g}, link_idle_s: 1, ping_timeout_s: 0.5, "
            "hello_timeout_s: 1, reconnect_max_s: 0.5, call_slack_s: 1, drain_s: 10, "
            "kill_after_s: 12}")
CONFIG = """
{timeouts}
api: {{host: {api}, workers: 1}}
transport: {transport}
runners:
  pids:
    model: fixture_models:paced_pid_echo
    {addresses}
    choice: least_loaded_of_two
    batch_timeout_ms: 1000
    batching: {{max_batch_size: 8, max_latency_ms: 2000}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: echo, datatype: FP32, shape: [-1, 4]}},
              {{name: pid, datatype: INT64, shape: [-1, 1]}}]
"""
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}


@dataclass(frozen=True)
class Answer:
    status: int
    error: str  # the 503's message, else ""
    retry_after: str | None
    pid: int | None  # the runner process that served a 200


@dataclass
class Cluster:
    net: Network
    folder: Path
    api: Host
    hosts: dict[str, Host]
    runners: dict[str, Runner] = field(default_factory=dict)
    front: Server | None = None

    def start(self, name: str, config: str = "runner.yml") -> Runner:
        host = self.hosts[name]
        runner = start_runner(self.folder / config, "pids", f"tcp:{host.ip}:{PORT}",
                              prefix=host.prefix)
        self.runners[name] = runner
        return runner

    def publish(self, *names: str) -> None:
        """The API host's hosts file now gives `NAME` these runner hosts."""
        self.net.hosts_file(self.api, {NAME: [self.hosts[name] for name in names]})

    def infer(self) -> Answer:
        assert self.front is not None
        with self.net.inside(self.api):
            answer = httpx.post(f"{self.front.url}/v2/models/pids/infer", json=BODY, timeout=30)
        if answer.status_code != 200:
            return Answer(answer.status_code, answer.json()["error"],
                          answer.headers.get("retry-after"), None)
        outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
        assert outputs["echo"] == [1, 2, 3, 4]
        return Answer(200, "", None, int(outputs["pid"][0]))

    def get(self, url: str) -> str:
        with self.net.inside(self.api):
            return httpx.get(url, timeout=10).text

    def served(self, name: str) -> float:
        """Rows runner `name` has run, by its own /metrics (one row per request here)."""
        text = self.get(self.runners[name].status + "/metrics")
        return metric(text, "batchserve_adaptive_batch_size_sum", runner="pids")

    def connected(self) -> float:
        assert self.front is not None
        text = self.get(self.front.url + "/metrics")
        return metric(text, "batchserve_runner_processes_connected", runner="pids")

    def pid(self, name: str) -> int:
        return self.runners[name].process.pid


class Stream:
    """Requests from a few threads, each sending its next when the last is answered, until
    stopped: each request's one answer is kept, and an exception (no answer) fails the test."""

    def __init__(self, cluster: Cluster, threads: int = 4) -> None:
        self.cluster = cluster
        self.answers: list[Answer] = []
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(threads)
        self._loops = [self._pool.submit(self._loop) for _ in range(threads)]

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self.sent += 1
            answer = self.cluster.infer()
            with self._lock:
                self.answers.append(answer)

    def wait(self, more: int, what: str) -> int:
        """Wait for `more` answers beyond those already in; the index they start at."""
        start = len(self.answers)
        wait_for(lambda: len(self.answers) >= start + more, 30, what)
        return start

    def stop(self) -> list[Answer]:
        self._stop.set()
        for loop in self._loops:
            loop.result(timeout=60)  # raises what a request raised
        self._pool.shutdown()
        assert len(self.answers) == self.sent
        return self.answers


def _cluster(net: Network, folder: Path) -> Cluster:
    shutil.copy(ROOT / "tests" / "fixture_models.py", folder / "fixture_models.py")
    (folder / "token").write_text(TOKEN + "\n")
    hosts = {name: net.host(name, number)
             for name, number in (("r1", 11), ("r2", 12), ("r3", 13), ("tls", 20))}
    api = net.host("api", 2)
    text = {"timeouts": TIMEOUTS, "api": api.ip, "transport": "{token_file: token}"}
    (folder / "runner.yml").write_text(CONFIG.format(addresses="", **text))
    (folder / "front.yml").write_text(CONFIG.format(
        addresses=f"addresses: [dns+tcp:{NAME}:{PORT}]", **text))
    return Cluster(net, folder, api, hosts)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"runner hosts in network namespaces: {why}")
    with Network() as net:
        made = _cluster(net, tmp_path_factory.mktemp("netns"))
        try:
            made.start("r1")
            made.start("r2")
            made.publish("r1", "r2")
            made.front = start_server(made.folder / "front.yml", "--api-only",
                                      prefix=made.api.prefix)
            yield made
        finally:
            if made.front is not None:
                made.front.stop()
            for runner in made.runners.values():
                stop_runner(runner)


def test_traffic_reaches_every_runner_host(cluster: Cluster) -> None:
    wait_for(lambda: cluster.connected() == 2, 30, "the front to connect to r1 and r2")
    before = {name: cluster.served(name) for name in ("r1", "r2")}
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: cluster.infer(), range(40)))
    assert [answer.status for answer in answers] == [200] * 40
    assert {answer.pid for answer in answers} == {cluster.pid("r1"), cluster.pid("r2")}
    served = {name: cluster.served(name) - before[name] for name in ("r1", "r2")}
    assert served["r1"] > 0 and served["r2"] > 0 and sum(served.values()) == 40, served


def test_a_runner_host_added_to_the_hosts_file_joins_within_the_refresh(
    cluster: Cluster,
) -> None:
    cluster.start("r3")
    joined = f"has 3 process(es): tcp:{cluster.hosts['r1'].ip}:{PORT}"
    assert cluster.front is not None
    front = cluster.front
    with Lookups(cluster.net.hosts_path(cluster.api)) as lookups:
        cluster.publish("r1", "r2", "r3")
        wait_for(lambda: any(joined in line for line in front.log), 30,
                 "the front to find r3 in the hosts file")
        # Counted as soon as r3 shows: the lookup that found it, and no later one, which
        # would come a refresh later. More would mean r3 was missed at the first refresh.
        found = lookups.poll()
        assert found <= 1, f"r3 joined after {found} lookups of the new hosts file"
        # And the count is not blind: the front's next lookup, at the next refresh, shows.
        wait_for(lambda: lookups.poll() > found, 30, "the front's next lookup of the name")
    wait_for(lambda: cluster.connected() == 3, 10, "the front to connect to r3")
    before = cluster.served("r3")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: cluster.infer(), range(40)))
    assert [answer.status for answer in answers] == [200] * 40
    assert cluster.pid("r3") in {answer.pid for answer in answers}
    assert cluster.served("r3") > before


def test_a_partitioned_host_is_dropped_and_every_request_is_answered(cluster: Cluster) -> None:
    """r2's cable is pulled with requests flowing: its connection is dropped once a ping goes
    unanswered; a call it held unstarted goes to another host, one it was running gets 503.
    No request goes unanswered or waits past its deadline; once dropped, r2 gets none. Its
    cable back, it is connected again."""
    stream = Stream(cluster)
    try:
        stream.wait(20, "answers before the partition")
        cluster.net.partition(cluster.hosts["r2"])
        wait_for(lambda: cluster.connected() == 2, 15, "the front to drop r2")
        after = stream.wait(40, "answers after r2 was dropped")
    finally:
        answers = stream.stop()
        cluster.net.mend(cluster.hosts["r2"])
    assert {answer.status for answer in answers} <= {200, 503}
    for answer in answers:
        if answer.status == 503:
            assert answer.retry_after is not None and answer.error, answer
    later = answers[after:]
    assert [answer.status for answer in later] == [200] * len(later)
    assert cluster.pid("r2") not in {answer.pid for answer in later}
    wait_for(lambda: cluster.connected() == 3, 15, "r2 to be connected again")


def test_a_drained_runner_loses_nothing(cluster: Cluster) -> None:
    """SIGTERM to r1 with requests flowing: it finishes what it holds, what is sent to it
    meanwhile runs elsewhere, and it exits 0; every request is answered 200."""
    stream = Stream(cluster)
    r1 = cluster.runners["r1"]
    try:
        stream.wait(20, "answers before the drain")
        r1.process.send_signal(signal.SIGTERM)
        assert r1.process.wait(30) == 0
        stream.wait(20, "answers after r1 exited")
    finally:
        answers = stream.stop()
    assert [answer.status for answer in answers] == [200] * len(answers), [
        answer for answer in answers if answer.status != 200]
    assert cluster.pid("r1") in {answer.pid for answer in answers}
    assert r1.logged("stopping: draining")
    cluster.publish("r2", "r3")  # as a Service would, once the pod is gone


def connect(cluster: Cluster, host: Host) -> socket.socket:
    with cluster.net.inside(cluster.api):
        return socket.create_connection((host.ip, PORT), timeout=10)


@pytest.mark.parametrize(("token", "why"), [
    (b"another token, of the right length", "its token does not match this runner's"),
    (None, "it holds no token, and this runner requires one"),
])
def test_without_the_token_a_runner_refuses_the_connection(
    cluster: Cluster, token: bytes | None, why: str
) -> None:
    r3 = cluster.hosts["r3"]
    with connect(cluster, r3) as connection:
        frames = FrameSocket(connection)
        with pytest.raises(Refused, match=f"^it refused this connection: {why}$"):
            greet(frames, "pids", token)
        assert connection.recv(1) == b""  # and closed
    with connect(cluster, r3) as connection:  # the token itself passes
        greet(FrameSocket(connection), "pids", TOKEN.encode())
    wait_for(lambda: cluster.runners["r3"].logged(why), 10, "r3 to log the refusal")


def test_with_tls_a_client_without_a_certificate_is_refused(cluster: Cluster) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test certificates")
    host = cluster.hosts["tls"]
    certs = cluster.folder / "certs"
    certs.mkdir()
    make_certificates(certs, host.ip)
    (cluster.folder / "tls.yml").write_text(CONFIG.format(
        timeouts=TIMEOUTS, api=cluster.api.ip, addresses="", transport=f"""
  token_file: token
  tls: {{runner_cert: {certs}/runner.pem, runner_key: {certs}/runner.key,
         api_ca: {certs}/ca.pem}}"""))
    runner = cluster.start("tls", "tls.yml")
    assert runner.logged("(token, TLS)")
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    with connect(cluster, host) as raw, context.wrap_socket(raw, server_hostname=host.ip) as tls:
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            if tls.recv(1) == b"":
                raise ConnectionResetError("closed without a Hello")
    context.load_cert_chain(certs / "api.pem", certs / "api.key")  # with one: served
    with connect(cluster, host) as raw, context.wrap_socket(raw, server_hostname=host.ip) as tls:
        greet(FrameSocket(tls), "pids", TOKEN.encode())
