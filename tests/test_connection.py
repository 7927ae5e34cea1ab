"""An API worker's HTTP/1.1 connections, spoken to byte by byte on a real socket: inference
answered in place keeps what HTTP promises around it (order, keep-alive, 100-continue,
limits), and the other routes still go through uvicorn and Starlette."""

from __future__ import annotations

import gc
import json
import shutil
import socket
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

from batchserve.api.http.connection import Connection, Exchange
from tests.conftest import ROOT, Server, start_server, wait_for
from tests.test_remote import metric

ECHO = """
api: {{workers: 1, max_body_bytes: {limit}}}
runners:
  echo:
    model: fixture_models:{model}
    batching: {{max_batch_size: 8, max_latency_ms: 2000}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 4]}}]
  gated:
    model: fixture_models:gated_echo
    batching: {{max_batch_size: 8, max_latency_ms: 30000}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 4]}}]
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the server runs; `gated_echo`'s `held` and `gate` files are made here."""
    return tmp_path_factory.mktemp("connection")


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[Server]:
    (folder / "configuration.yml").write_text(ECHO.format(limit=4096, model="slow_echo"))
    shutil.copy(ROOT / "tests" / "fixture_models.py", folder / "fixture_models.py")
    running = start_server(folder / "configuration.yml")
    yield running
    running.stop()


def body(*values: float) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": list(values)}
    return json.dumps({"inputs": [tensor]}).encode()


def request(path: str, content: bytes, *headers: str, method: str = "POST",
            version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: test", *headers]
    if content or method == "POST":
        lines.append(f"Content-Length: {len(content)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + content


class Wire:
    """A raw client connection that reads whole HTTP responses."""

    def __init__(self, server: Server) -> None:
        url = urlsplit(server.url)
        self.socket = socket.create_connection((url.hostname, url.port), timeout=20)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.socket.sendall(data)

    def _fill(self) -> bool:
        chunk = self.socket.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill():
                raise ConnectionError(f"closed before a response: {self.buffer!r}")
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            if not self._fill():
                raise ConnectionError("closed inside a body")
        content, self.buffer = self.buffer[:length], self.buffer[length:]
        return status, headers, content

    def closed(self) -> bool:
        """Whether the server closed the connection (after whatever it sent)."""
        try:
            return not self._fill()
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.socket.close()


Connect = Callable[[], "Wire"]


@pytest.fixture
def connect(server: Server) -> Iterator[Connect]:
    """Open raw connections to the server; each is closed after the test."""
    opened: list[Wire] = []

    def open_one() -> Wire:
        opened.append(Wire(server))
        return opened[-1]

    yield open_one
    for wire in opened:
        wire.close()


def test_pipelined_requests_are_answered_in_order_on_one_connection(connect: Connect) -> None:
    wire = connect()
    infer = "/v2/models/echo/infer"
    wire.send(request(infer, body(1, 2, 3, 4)) + request("/v2/health/live", b"", method="GET")
              + request(infer, body(5, 6, 7, 8)) + request("/v2/models/nope/infer", body(1)))
    first, live, second, unknown = (wire.response() for _ in range(4))
    assert first[0] == 200 and json.loads(first[2])["outputs"][0]["data"] == [1, 2, 3, 4]
    assert live[0] == 200 and live[2] == b'{"live":true}'
    assert second[0] == 200 and json.loads(second[2])["outputs"][0]["data"] == [5, 6, 7, 8]
    assert unknown[0] == 404 and b"'nope' is not served here" in unknown[2]


def test_a_connection_serves_many_requests_and_says_when_it_closes(connect: Connect) -> None:
    wire = connect()
    for i in range(3):
        wire.send(request("/v2/models/echo/versions/1/infer", body(i, i, i, i)))
        status, headers, content = wire.response()
        assert status == 200, content
        assert headers["content-type"] == "application/json"
        assert "connection" not in headers and "date" in headers
    wire.send(request("/v2/models/echo/infer", body(9, 9, 9, 9), "Connection: close"))
    status, headers, _ = wire.response()
    assert (status, headers["connection"]) == (200, "close")
    assert wire.closed()


def test_http_1_0_gets_its_answer_and_the_connection_closed(connect: Connect) -> None:
    wire = connect()
    wire.send(request("/v2/models/echo/infer", body(1, 1, 1, 1), version="1.0"))
    status, headers, _ = wire.response()
    assert (status, headers["connection"]) == (200, "close")
    assert wire.closed()


def test_expect_100_continue_is_answered_before_the_body_is_sent(connect: Connect) -> None:
    wire = connect()
    content = body(1, 2, 3, 4)
    wire.send(request("/v2/models/echo/infer", b"", "Expect: 100-continue")
              .replace(b"Content-Length: 0", f"Content-Length: {len(content)}".encode()))
    assert wire.response()[0] == 100
    wire.send(content)
    status, _, answer = wire.response()
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [1, 2, 3, 4]


def test_a_chunked_body_is_gathered_whole(connect: Connect) -> None:
    wire = connect()
    content = body(4, 3, 2, 1)
    half = len(content) // 2
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part)
                      for part in (content[:half], content[half:])) + b"0\r\n\r\n"
    head = request("/v2/models/echo/infer", b"", "Transfer-Encoding: chunked")
    wire.send(head.replace(b"Content-Length: 0\r\n", b"") + chunks)
    status, _, answer = wire.response()
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [4, 3, 2, 1]


def test_a_body_over_the_limit_is_refused_from_its_header_and_the_connection_closed(
    connect: Connect,
) -> None:
    wire = connect()
    wire.send(request("/v2/models/echo/infer", b"", "Content-Length: 100000")
              .replace(b"Content-Length: 0\r\n", b""))
    status, headers, content = wire.response()
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(content) == {
        "error": "request body of 100000 bytes exceeds the limit of 4096 bytes"}
    assert wire.closed()


def test_a_chunked_body_that_grows_over_the_limit_is_refused(connect: Connect) -> None:
    wire = connect()
    head = request("/v2/models/echo/infer", b"", "Transfer-Encoding: chunked")
    wire.send(head.replace(b"Content-Length: 0\r\n", b"") + b"%x\r\n%s\r\n" % (5000, b"[" * 5000))
    status, headers, content = wire.response()
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(content) == {"error": "request body exceeds the limit of 4096 bytes"}


def test_bad_http_is_answered_400_and_the_worker_serves_on(connect: Connect) -> None:
    wire = connect()
    wire.send(b"POST /v2/models/echo/infer HTTP/1.1\r\nContent-Length: zz\r\n\r\n")
    assert wire.response()[0] == 400
    wire = connect()
    wire.send(request("/v2/models/echo/infer", body(2, 2, 2, 2)))
    assert wire.response()[0] == 200


TCP_CLOSE = 7  # a socket's state in TCP_INFO once both ends have closed (linux/tcp_states.h)


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of a socket (the first byte of its TCP_INFO)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def gated_counts(server: Server) -> tuple[float, float]:
    """Requests to `gated` answered 200 so far, and those sent to its runner and unanswered."""
    with server.client() as client:
        text = client.get("/metrics").text
    return (metric(text, "batchserve_requests_total", runner="gated", code="200"),
            metric(text, "batchserve_inflight_requests", runner="gated"))


def test_a_client_that_leaves_mid_request_costs_nothing_else(
    server: Server, connect: Connect, folder: Path
) -> None:
    """A client shuts its socket with its request queued behind a batch held in the model,
    among three other clients' requests: the worker closes its end while no answer can come
    yet, and once the batch goes on, it runs and counts that request once, answers the others
    theirs, keeps nothing in flight, logs nothing and serves on."""
    infer = "/v2/models/gated/infer"
    answered_before, _ = gated_counts(server)
    logged_before = len(server.log)
    others = [connect() for _ in range(3)]
    leaving = connect()
    try:
        others[0].send(request(infer, body(-1, -1, -1, -1)))  # -1: held at the gate
        wait_for((folder / "held").exists, 30, "the first request's batch to be in the model")
        for i, wire in enumerate(others[1:], 1):
            wire.send(request(infer, body(i, i, i, i)))
        leaving.send(request(infer, body(3, 3, 3, 3)))
        leaving.socket.shutdown(socket.SHUT_RDWR)  # gone with its request unanswered
        # No answer can come while the gate is shut: the worker closes on the client leaving.
        wait_for(lambda: tcp_state(leaving.socket) == TCP_CLOSE, 10,
                 "the worker to close the connection its client left")
    finally:
        (folder / "gate").touch()
    for i, wire in zip((-1, 1, 2), others, strict=True):  # the others get their own answers
        status, _, content = wire.response()
        assert status == 200 and json.loads(content)["outputs"][0]["data"] == [i, i, i, i]
    # The left request ran, was answered into the void and counted once; none is in flight.
    wait_for(lambda: gated_counts(server) == (answered_before + 4, 0), 10,
             "all four requests counted, the left one included, and none in flight")
    again = connect()
    again.send(request(infer, body(4, 4, 4, 4)))
    status, _, content = again.response()
    assert status == 200 and json.loads(content)["outputs"][0]["data"] == [4, 4, 4, 4]
    wait_for(lambda: gated_counts(server) == (answered_before + 5, 0), 10,
             "the later request counted too")
    assert server.log[logged_before:] == []  # no error, no warning


class _Gone:
    """A connection whose client left: answers are dropped, as on a real one."""

    write_answer = Connection.write_answer
    _write = Connection._write
    transport = SimpleNamespace(is_closing=lambda: True)

    def on_response_complete(self) -> None:
        pass


class _Request:
    """The service's side of an exchange: it holds the connection's `respond`."""

    done = False


def test_an_answered_request_is_freed_at_once_not_by_the_collector() -> None:
    """The two sides of a request point at each other until it is answered; after that
    nothing may hold them, or every request waits for a garbage collection to be freed."""
    exchange = Exchange(_Gone(), keep_alive=True, expect_continue=False)  # type: ignore[arg-type]
    service_side = _Request()
    service_side.respond = exchange.respond  # type: ignore[attr-defined]
    exchange.request = service_side  # type: ignore[assignment]
    exchange.started = True
    gone = weakref.ref(service_side)
    gc.disable()
    try:
        service_side.respond(200, b"{}", {})  # type: ignore[attr-defined]
        del service_side, exchange
        assert gone() is None
    finally:
        gc.enable()


KEEP_ALIVE_S = 1.0


@pytest.fixture(scope="module")
def brief(folder: Path) -> Iterator[Server]:
    """A server that keeps an idle connection for a second, its `echo` taking 1.5 s a batch."""
    config = folder / "brief.yml"
    config.write_text(ECHO.format(limit=4096, model="slow_echo").replace(
        "api: {workers: 1,", f"timeouts: {{keep_alive_s: {KEEP_ALIVE_S}}}\napi: {{workers: 1,")
        .replace("fixture_models:slow_echo", "fixture_models:sleepy_echo"))
    shutil.copy(ROOT / "tests" / "fixture_models.py", folder / "fixture_models.py")
    running = start_server(config)
    yield running
    running.stop()


def test_keep_alive_closes_an_idle_connection_not_one_in_use(brief: Server) -> None:
    """The keep-alive timer is armed once and moved on by each answer: a connection that
    sends every 0.4 s for longer than the timeout stays open, one whose request takes longer
    than the timeout gets its answer, and one idle for the timeout is closed."""
    wire = Wire(brief)
    try:
        wire.send(request("/v2/models/echo/infer", body(1, 2, 3, 4)))
        status, _, content = wire.response()  # 1.5 s in the model: longer than the timeout
        assert status == 200 and json.loads(content)["outputs"][0]["data"] == [1, 2, 3, 4]
        for i in range(5):  # 2 s of requests, each well within the timeout of the last
            time.sleep(0.4)
            wire.send(request("/v2/health/live", b"", method="GET"))
            assert wire.response()[0] == 200, f"request {i}"
        answered = time.monotonic()
        wire.socket.settimeout(10 * KEEP_ALIVE_S)
        assert wire.closed()  # the server closed it, idle
        assert time.monotonic() - answered >= 0.9 * KEEP_ALIVE_S  # not before its time
    finally:
        wire.close()
