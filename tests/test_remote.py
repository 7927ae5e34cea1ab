"""Runners on other hosts, played on 127.0.0.1: `batchserve runner` alone on a TCP port, and
`batchserve serve --api-only` in front of it; the token, TLS with client certificates and the
handshake's refusals, all with real processes; a gRPC call takes the same TLS link."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc
from prometheus_client.parser import text_string_to_metric_families

from batchserve.api.http.app import create_app
from batchserve.runner.core.config import load
from batchserve.runner.core.handshake import answer
from batchserve.runner.core.security import credentials
from batchserve.runner.core.wire import (
    PROTOCOL_VERSION,
    Call,
    Failure,
    FailureCode,
    FrameSocket,
    Hello,
    Result,
    Results,
    Welcome,
    encode,
)
from tests.conftest import BATCHSERVE, START_S, Server, free_port, start_server, wait_for

RUNNER = """
{transport}
runners:
  iris_clf:
    model: batchserve.runner.bundled:iris_classifier
    {addresses}
    batching: {{max_batch_size: 100, max_latency_ms: 500}}
    inputs: [{{name: input, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: scores, datatype: FP32, shape: [-1, 3]}}]
"""
TOKEN = "0123456789abcdef0123456789abcdef"
ROWS = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]
BODY = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 4], "data": ROWS}]}
Front = Callable[..., Server]
READY = re.compile(r"ready on (tcp:[\d.]+:\d+)")
STATUS = re.compile(r"metrics and health on (http://[\d.]+:\d+)")


@dataclass
class Runner:
    """A `batchserve runner` process, where it listens and what it has logged."""

    process: subprocess.Popen[str]
    reader: threading.Thread | None = None
    address: str = ""
    status: str = ""
    log: list[str] = field(default_factory=list)

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.log)


def start_runner(config: Path, runner_name: str = "iris_clf",
                 listen: str = "tcp:127.0.0.1:0", prefix: Sequence[str] = ()) -> Runner:
    """Start `batchserve runner` and wait for its ready line; `prefix` runs it under another
    command (`ip netns exec NS`)."""
    process = subprocess.Popen(
        [*prefix, BATCHSERVE, "runner", "--config", str(config), "--runner", runner_name,
         "--listen", listen, "--metrics-port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        cwd=config.parent,
    )
    runner = Runner(process)
    ready = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            runner.log.append(line)
            if match := STATUS.search(line):
                runner.status = match[1]
            if match := READY.search(line):
                runner.address = match[1]
                ready.set()
        ready.set()

    runner.reader = threading.Thread(target=read, daemon=True)
    runner.reader.start()
    if not ready.wait(START_S) or not runner.address:
        process.kill()
        stop_runner(runner)
        raise RuntimeError("the runner did not start:\n" + "".join(runner.log))
    return runner


def stop_runner(runner: Runner) -> int:
    if runner.process.poll() is None:
        runner.process.send_signal(signal.SIGTERM)
    code = runner.process.wait(15)
    if runner.reader is not None:
        runner.reader.join(15)
    assert runner.process.stderr is not None
    runner.process.stderr.close()
    return code


def write(folder: Path, name: str, transport: str, addresses: str = "") -> Path:
    path = folder / name
    path.write_text(RUNNER.format(transport=transport, addresses=addresses))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("remote")
    (path / "token").write_text(TOKEN + "\n")
    (path / "wrong").write_text("another token, of the right length\n")
    return path


@pytest.fixture(scope="module")
def runner(folder: Path) -> Iterator[Runner]:
    """One runner alone on a TCP port, holding the token."""
    process = start_runner(write(folder, "runner.yml", "transport: {token_file: token}"))
    yield process
    assert stop_runner(process) == 0, "".join(process.log)


@pytest.fixture
def front(tmp_path: Path) -> Iterator[Front]:
    """`batchserve serve --api-only` with one worker, stopped after the test."""
    servers: list[Server] = []

    def start(transport: str, address: str, *args: str) -> Server:
        config = write(tmp_path, "front.yml", transport, f"addresses: [{address}]")
        server = start_server(config, "--api-only", "--api-workers", "1", *args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        assert server.stop() == 0, "".join(server.log)


def infer(server: Server) -> httpx.Response:
    with server.client() as client:
        return client.post("/v2/models/iris_clf/infer", json=BODY)


def metric(text: str, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def ready(server: Server) -> bool:
    with server.client() as client:
        return client.get("/v2/health/ready").status_code == 200


def test_a_runner_alone_serves_an_api_only_front(
    runner: Runner, folder: Path, front: Front
) -> None:
    for path in ("/health/live", "/health/ready"):
        assert httpx.get(runner.status + path).status_code == 200
    server = front(f"transport: {{token_file: {folder}/token}}", runner.address)
    wait_for(lambda: ready(server), 30, "the front to connect to the runner")
    answer = infer(server)
    assert answer.status_code == 200, answer.text
    scores = answer.json()["outputs"][0]["data"]
    assert len(scores) == 6 and max(scores[:3]) == scores[0] and max(scores[3:]) == scores[5]
    # The runner's own /metrics counts the batch: a remote runner is scraped where it runs.
    text = httpx.get(runner.status + "/metrics").text
    assert metric(text, "batchserve_batches_total", runner="iris_clf") >= 1
    assert metric(text, "batchserve_runner_starts_total", runner="iris_clf") == 1


def test_an_api_worker_starts_serving_only_once_its_runner_link_is_through(
    runner: Runner, folder: Path
) -> None:
    """A worker that reported ready while its link was still shaking hands answered its first
    requests 503 (`unreachable`): a supervisor whose other worker died then served 503s."""
    path = write(folder, "starting.yml", "transport: {token_file: token}",
                 f"addresses: [{runner.address}]")
    config = load(path)
    app = create_app(config, {"iris_clf": config.runners["iris_clf"].addresses},
                     credentials(config))

    async def first_request() -> httpx.Response:
        async with app.routes.router.lifespan_context(app.routes):  # the worker's start-up
            assert app.service.pools["iris_clf"].ready
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.post("/v2/models/iris_clf/infer", json=BODY)

    answer = asyncio.run(first_request())
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(("transport", "why"), [
    ("transport: {{token_file: {folder}/wrong}}", "its token does not match this runner's"),
    ("transport: {{insecure: true}}", "it holds no token, and this runner requires one"),
])
def test_a_front_without_the_token_is_refused_and_answers_503(
    runner: Runner, folder: Path, front: Front, transport: str, why: str
) -> None:
    server = front(transport.format(folder=folder), runner.address)
    wait_for(lambda: runner.logged(why), 30, "the runner to refuse the front")
    answer = infer(server)
    assert answer.status_code == 503
    assert answer.json() == {"error": "no process of runner 'iris_clf' is reachable",
                             "reason": "unreachable"}
    with server.client() as client:
        assert client.get("/v2/health/ready").status_code == 503
        text = client.get("/metrics").text
    assert metric(text, "batchserve_unavailable_total", reason="unreachable") == 1
    assert any(f"is unreachable: it refused this connection: {why}" in line
               for line in server.log)


def test_a_hello_of_another_version_is_refused_and_closed(runner: Runner) -> None:
    host, port = runner.address.removeprefix("tcp:").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        frames = FrameSocket(connection)
        first = frames.receive()
        assert isinstance(first, Hello)
        assert (first.version, first.runner, first.max_batch_size) == (
            PROTOCOL_VERSION, "iris_clf", 100)
        frames.send(Hello(PROTOCOL_VERSION + 1, "iris_clf", 0, bytes(32)))
        refusal = frames.receive()
        assert refusal == Failure(0, FailureCode.HANDSHAKE, (
            f"it speaks protocol version {PROTOCOL_VERSION + 1}; this end speaks "
            f"{PROTOCOL_VERSION}"))
        assert connection.recv(1) == b""  # closed
    # The runner logs the refusal as it closes; its log is read on another thread.
    wait_for(lambda: runner.logged(f"protocol version {PROTOCOL_VERSION + 1}"), 30,
             "the runner to log the refused version")


def test_a_batchs_answers_come_back_to_its_connection_in_one_frame(folder: Path) -> None:
    # Eight calls in one write are read together and run as one batch (or a few): however
    # many answers a batch has for a connection, they come in one frame, not one each.
    plain = start_runner(write(folder, "plain.yml", "transport: {insecure: true}"))
    try:
        host, port = plain.address.removeprefix("tcp:").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            frames = FrameSocket(connection)
            frames.send(answer(frames.receive(), "iris_clf", None))
            assert isinstance(frames.receive(), Welcome)
            rows = {ident: np.array([ROWS[ident % 2]], np.float32) for ident in range(1, 9)}
            connection.sendall(b"".join(bytes(chunk) for ident, x in rows.items()
                                        for chunk in encode(Call(ident, 5.0, 1, {"input": x}))))
            answered: dict[int, np.ndarray] = {}
            carrying = 0  # frames that carry answers
            while len(answered) < len(rows):
                message = frames.receive()
                if isinstance(message, Results | Result):
                    carrying += 1
                    for one in message.answers() if isinstance(message, Results) else [message]:
                        answered[one.id] = one.tensors["scores"]
        batches = metric(httpx.get(f"{plain.status}/metrics").text, "batchserve_batches_total")
    finally:
        stop_runner(plain)
    assert sorted(answered) == sorted(rows)
    assert all(scores.shape == (1, 3) for scores in answered.values())
    np.testing.assert_array_equal(answered[2], answered[4])  # the same row, the same scores
    assert 1 <= carrying == batches < len(rows), (carrying, batches)


# --- TLS ---------------------------------------------------------------------------------------


def openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


def make_certificates(folder: Path, runner_ip: str = "127.0.0.1") -> None:
    """A throwaway CA, a runner certificate for `runner_ip` and an API client certificate."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(folder, "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=batchserve test CA")
    for name, extension in (("runner", f"subjectAltName=IP:{runner_ip}"),
                            ("api", "extendedKeyUsage=clientAuth")):
        (folder / f"{name}.ext").write_text(extension + "\n")
        openssl(folder, "req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")
        openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey",
                "ca.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def tls_runner(folder: Path) -> Iterator[Runner]:
    """A runner that serves TLS and requires a client certificate from the test CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test certificates")
    certs = folder / "certs"
    certs.mkdir()
    make_certificates(certs)
    process = start_runner(write(folder, "tls-runner.yml", f"""transport:
  token_file: token
  tls: {{runner_cert: {certs}/runner.pem, runner_key: {certs}/runner.key,
         api_ca: {certs}/ca.pem}}"""))
    yield process
    assert stop_runner(process) == 0, "".join(process.log)


def api_tls(folder: Path, client_certificate: bool) -> str:
    certs = folder / "certs"
    mine = f", api_cert: {certs}/api.pem, api_key: {certs}/api.key" if client_certificate else ""
    return f"""transport:
  token_file: {folder}/token
  tls: {{runner_ca: {certs}/ca.pem{mine}}}"""


def test_tls_with_a_client_certificate_serves(
    tls_runner: Runner, folder: Path, front: Front
) -> None:
    server = front(api_tls(folder, True), tls_runner.address)
    wait_for(lambda: ready(server), 30, "the front to connect to the TLS runner")
    answer = infer(server)
    assert answer.status_code == 200, answer.text
    assert tls_runner.logged("(token, TLS)")


def test_a_grpc_call_is_answered_over_tls_and_the_token(
    tls_runner: Runner, folder: Path, front: Front
) -> None:
    """The gRPC door takes the same way to a runner as HTTP: here a TLS link with a client
    certificate and the token."""
    server = front(api_tls(folder, True), tls_runner.address, "--grpc-port", str(free_port()))
    wait_for(lambda: ready(server), 30, "the front to connect to the TLS runner")
    client = tritonclient.grpc.InferenceServerClient(server.grpc)
    rows = tritonclient.grpc.InferInput("input", [2, 4], "FP32")
    rows.set_data_from_numpy(np.array(ROWS, np.float32))
    result = client.infer("iris_clf", [rows], request_id="tls", client_timeout=10)
    assert result.get_response().id == "tls"
    assert result.as_numpy("scores").argmax(axis=1).tolist() == [0, 2]
    client.close()
    assert tls_runner.logged("(token, TLS)")


def test_tls_without_a_client_certificate_is_refused(
    tls_runner: Runner, folder: Path, front: Front
) -> None:
    server = front(api_tls(folder, False), tls_runner.address)
    wait_for(lambda: any("closed the connection during the handshake" in line
                         for line in server.log), 30, "the front to give up on the runner")
    assert infer(server).status_code == 503
    # The same, by hand: TLS succeeds on the client's side, then the runner closes unheard.
    context = ssl.create_default_context(cafile=str(folder / "certs" / "ca.pem"))
    host, port = tls_runner.address.removeprefix("tcp:").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=host) as connection:
            with pytest.raises((ssl.SSLError, ConnectionResetError)):
                if connection.recv(1) == b"":
                    raise ConnectionResetError("closed without a Hello")
