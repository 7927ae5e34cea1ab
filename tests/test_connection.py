"""An API worker's HTTP/1.1 connections, spoken to byte by byte on a real socket: inference
answered in place keeps what HTTP promises around it (order, keep-alive, 100-continue,
limits), and the other routes still go through uvicorn and Starlette."""

from __future__ import annotations

import gc
import json
import shutil
import socket
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

from batchserve.api.connection import Connection, Exchange
from tests.conftest import ROOT, Server, start_server

ECHO = """
api: {{workers: 1, max_body_bytes: {limit}}}
runners:
  echo:
    model: fixture_models:{model}
    batching: {{max_batch_size: 8, max_latency_ms: 2000}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 4]}}]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("connection")
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
    assert live[0] == 200 and live[2] == b"{}"
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


def test_a_client_that_leaves_mid_request_costs_nothing_else(
    server: Server, connect: Connect
) -> None:
    wire = connect()
    wire.send(request("/v2/models/echo/infer", body(3, 3, 3, 3)))
    wire.socket.shutdown(socket.SHUT_RDWR)  # gone before the 300 ms batch answers
    again = connect()
    again.send(request("/v2/models/echo/infer", body(4, 4, 4, 4)))
    assert again.response()[0] == 200
    with server.client() as client:
        text = client.get("/metrics").text
    assert 'batchserve_requests_total{code="200",runner="echo"}' in text


class _Gone:
    """A connection whose client left: answers are dropped, as on a real one."""

    write_answer = Connection.write_answer
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
