"""One client's HTTP/1.1 connection to an API worker: inference answered in place.

uvicorn's httptools protocol, with the inference route taken off its ASGI path: a request for
`POST /v2/models/{name}[/versions/{version}]/infer` is admitted once its headers are parsed
(a refusal is written at once, before the body is read), its body is gathered as httptools
delivers it, and the whole body goes straight to `batchserve.api.service`, whose answer is
written with one `write`. Such a request builds no ASGI scope or messages and runs no task;
every other request (health, metadata, metrics, errors on unknown routes) takes uvicorn's
own path to the Starlette app.

An inference request stands in uvicorn's place of a request cycle (`Exchange`), so
uvicorn's handling of what surrounds requests holds for both kinds alike: responses leave in
the order requests came (a request pipelined behind another waits for it), keep-alive and
its timeout, `Expect: 100-continue`, and a graceful shutdown that closes each connection once
its answer is written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from email.utils import formatdate
from importlib.metadata import version
from typing import Any

import httptools
import uvicorn.protocols.http.httptools_impl as httptools_impl
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import Server, ServerState

from .. import service as inference
from ..errors import Overloaded, PayloadTooLarge, error_response

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_STATUS_LINE: dict[int, bytes] = getattr(httptools_impl, "STATUS_LINE", {})
HOOKS = ("on_message_begin", "on_headers_complete", "on_body", "on_message_complete",
         "on_response_complete", "_start_asgi_task", "_unset_keepalive_if_required",
         "timeout_keep_alive_handler")
"""uvicorn's protocol methods this one overrides or calls."""
STATE = ("parser", "headers", "url", "cycle", "pipeline", "flow", "server_state", "config",
         "loop", "timeout_keep_alive", "timeout_keep_alive_task",
         "app_state", "root_path", "asgi_version", "server", "client", "scheme", "transport",
         "expect_100_continue")
"""Its attributes read or set here (some only once a connection is made)."""


def missing_internals() -> list[str]:
    """What this module uses of uvicorn that the installed uvicorn does not have."""
    missing = [] if hasattr(httptools_impl, "STATUS_LINE") else ["STATUS_LINE"]
    missing += [f"HttpToolsProtocol.{name}" for name in HOOKS
                if not callable(getattr(HttpToolsProtocol, name, None))]
    config = Config(app=_no_app, http="httptools", lifespan="off")
    config.load()
    state = ServerState()
    loop = asyncio.new_event_loop()  # the protocol takes one; none need be running
    try:
        protocol = HttpToolsProtocol(config, state, {}, _loop=loop)
        protocol.on_message_begin()  # sets the per-request attributes
    finally:
        loop.close()
    missing += [f"HttpToolsProtocol.{name}" for name in STATE if not hasattr(protocol, name)]
    missing += [f"ServerState.{name}" for name in ("default_headers",)
                if not hasattr(state, name)]
    missing += [f"Config.{name}" for name in ("date_header", "encoded_headers",
                                              "http_protocol_class", "lifespan_class")
                if not hasattr(config, name)]
    server = Server(config)  # the worker builds its connections as uvicorn's startup does
    missing += [f"Server.{name}" for name in ("server_state",) if not hasattr(server, name)]
    return missing


class UnsupportedUvicorn(RuntimeError):
    """The installed uvicorn lacks internals this module uses."""


def check_uvicorn() -> None:
    """Fail at once, naming the version, when the installed uvicorn lacks what is used here."""
    missing = missing_internals()
    if missing:
        raise UnsupportedUvicorn(
            f"uvicorn {version('uvicorn')} lacks what batchserve's HTTP connection uses: "
            f"{', '.join(missing)}; install the version pyproject.toml names")


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    """The app of the protocol `missing_internals` builds: it serves nothing."""


class _Quiet:
    """What uvicorn sets to wake a cycle's reader; an inference request has none."""

    __slots__ = ()

    def set(self) -> None:
        pass


_QUIET = _Quiet()


class _Date:
    """The default headers (`date`, `server`), made again once a second by whichever request
    sees it first: an idle worker keeps no timer for them."""

    second = -1
    lines = b""  # the default headers, as they are written

    @classmethod
    def refresh(cls, protocol: HttpToolsProtocol) -> None:
        now = time.time()
        if int(now) != cls.second:
            cls.second = int(now)
            state, config = protocol.server_state, protocol.config
            date = [(b"date", formatdate(now, usegmt=True).encode())] if config.date_header else []
            state.default_headers = date + config.encoded_headers
            cls.lines = b"".join(b"%s: %s\r\n" % pair for pair in state.default_headers)


_LINES: dict[tuple[str, str], bytes] = {}
"""Response header lines as written, by name and value: a few, again and again."""


def _line(name: str, value: str) -> bytes:
    line = _LINES.get((name, value))
    if line is None:
        line = f"{name}: {value}\r\n".encode("latin-1")
        if len(_LINES) < 256:
            _LINES[name, value] = line
    return line


class Exchange:
    """One inference request on a connection, in uvicorn's place of an ASGI request cycle."""

    __slots__ = ("connection", "request", "chunks", "size", "header_length", "keep_alive",
                 "expect_continue", "complete", "started", "kept", "response_complete",
                 "disconnected")

    message_event = _QUIET

    def __init__(self, connection: Connection, keep_alive: bool, expect_continue: bool) -> None:
        self.connection = connection
        self.request: inference.Exchange | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.header_length: str | None = None
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.complete = False  # the whole body has arrived
        self.started = False  # its turn on the connection came: nothing is answered ahead
        self.kept: tuple[int, bytes, Mapping[str, str]] | None = None  # answered before then
        self.response_complete = False
        self.disconnected = False

    @property
    def waiting(self) -> bool:
        """Whether the service still waits for this request's body."""
        return self.request is not None and not self.request.done

    def begin(self) -> None:
        """Its turn: answered now if it was refused already, run once its body is in."""
        self.started = True
        if self.kept is not None:
            self.connection.write_answer(self, *self.kept)
        elif self.waiting:
            if self.complete:
                self.run()
            elif self.expect_continue:
                self.connection.transport.write(_CONTINUE)

    def run(self) -> None:
        request = self.request
        assert request is not None
        chunks, self.chunks = self.chunks, []
        request.run(chunks[0] if len(chunks) == 1 else b"".join(chunks), self.header_length)

    def respond(self, status: int, content: bytes, headers: Mapping[str, str]) -> None:
        """The service's answer: written now if it is this request's turn, else kept."""
        if self.started:
            self.connection.write_answer(self, status, content, headers)
        else:
            self.kept = (status, content, headers)


class Connection(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with inference requests answered by the service."""

    service: inference.Service  # set on a subclass made per worker by `protocol_for`
    _refused: tuple[Overloaded | None, bytes, bytes] = (None, b"", b"")
    """The last front refusal written, the date line it was written with, and its bytes."""

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.exchange: Exchange | None = None

    def on_headers_complete(self) -> None:
        _Date.refresh(self)
        parser = self.parser
        if parser.get_method() == b"POST":
            path = self.url.partition(b"?")[0]
            if b"%" not in path:  # an escaped path takes the general one, which unescapes
                target = inference.infer_target(path.decode("latin-1"))
                if target is not None:
                    self._begin_inference(*target)
                    return
        self._begin_scope()
        super().on_headers_complete()

    def _begin_scope(self) -> None:
        """The ASGI scope that uvicorn builds on a message's begin, built only for requests
        that take its path."""
        self.scope = {  # type: ignore[typeddict-item]
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }

    def _begin_inference(self, name: str, version: str | None) -> None:
        parser = self.parser
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        exchange = self.exchange = Exchange(self, keep_alive, self.expect_100_continue)
        ahead = self.cycle
        self.cycle = exchange  # type: ignore[assignment]
        if keep_alive and (ahead is None or ahead.response_complete):
            refusal = self.service.refused_at_front(name, version)
            if refusal is not None:  # its body is read and dropped (`on_body`)
                exchange.started = True
                self._write_refusal(exchange, refusal)
                return
        length = None
        for key, value in self.headers:
            if key == b"content-length":
                length = value
            elif key == b"inference-header-content-length":
                exchange.header_length = value.decode("latin-1")
        request = exchange.request = self.service.request(name, version, exchange.respond)
        limit = self.service.config.api.max_body_bytes
        if not request.done and length is not None and length.isdigit() and int(length) > limit:
            request.fail(PayloadTooLarge(limit, int(length)))
            exchange.keep_alive = False  # its body is not read: the connection cannot go on
        if ahead is None or ahead.response_complete:
            exchange.begin()
        else:  # pipelined behind a request still being answered: wait for its turn
            self.flow.pause_reading()
            self.pipeline.appendleft((exchange, None))  # type: ignore[arg-type]

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            super().on_body(body)
            return
        request = exchange.request
        if request is None or request.done:
            return
        exchange.size += len(body)
        limit = self.service.config.api.max_body_bytes
        if exchange.size > limit:
            exchange.chunks = []
            exchange.keep_alive = False  # the rest of its body is not read
            request.fail(PayloadTooLarge(limit))
            return
        exchange.chunks.append(body)

    def on_message_complete(self) -> None:
        exchange = self.exchange
        if exchange is None:
            super().on_message_complete()
            return
        self.exchange = None
        exchange.complete = True
        if exchange.started and exchange.waiting:
            exchange.run()

    def on_response_complete(self) -> None:
        """uvicorn's, with its keep-alive timer armed once for many requests: it made and
        cancelled a timer for every request, some 3 µs of each. The timer stays armed while
        requests come, and when it fires on a connection idle for less than the keep-alive
        timeout, it is armed again for the rest (`timeout_keep_alive_handler`)."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self.idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_at(
                self.idle_since + self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _unset_keepalive_if_required(self) -> None:
        """uvicorn cancels the keep-alive timer at every read; it is cancelled here only
        once the connection closes, and judges itself whether the connection is idle."""
        if self.transport.is_closing():
            super()._unset_keepalive_if_required()

    def timeout_keep_alive_handler(self) -> None:
        """Close a connection idle for the keep-alive timeout. One in the middle of a request
        is left to its answer, which arms the timer again; one idle for less is given the
        rest."""
        self.timeout_keep_alive_task = None
        cycle = self.cycle
        if self.transport.is_closing() or (cycle is not None and not cycle.response_complete):
            return
        due = self.idle_since + self.timeout_keep_alive
        if self.loop.time() >= due:
            self.transport.close()
        else:
            self.timeout_keep_alive_task = self.loop.call_at(due, self.timeout_keep_alive_handler)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if isinstance(cycle, Exchange):  # an inference request whose turn came
            cycle.begin()
        else:
            super()._start_asgi_task(cycle, app)

    def write_answer(self, exchange: Exchange, status: int, content: bytes,
                     headers: Mapping[str, str]) -> None:
        """Write one whole response, then let what waits behind it go on."""
        if exchange.response_complete:
            return
        keep_alive = exchange.keep_alive and headers.get("Connection") != "close"
        self._write(exchange, _response(status, content, headers, keep_alive), keep_alive)

    def _write_refusal(self, exchange: Exchange, refusal: Overloaded) -> None:
        """Write a front refusal of a keep-alive request: the bytes written for the same
        refusal the last time, while the date line is the same too."""
        kept = self._refused
        if kept[0] is not refusal or kept[1] is not _Date.lines:
            status, content, headers = error_response(refusal)
            kept = type(self)._refused = (refusal, _Date.lines,
                                          _response(status, content, headers, True))
        self._write(exchange, kept[2], True)

    def _write(self, exchange: Exchange, response: bytes, keep_alive: bool) -> None:
        exchange.response_complete = True
        # The service's exchange holds our `respond`: unlinked now, the pair goes when the
        # request does, not at the collector's next pass (one cycle a request kept it busy).
        exchange.request = None
        transport = self.transport
        if not exchange.disconnected and not transport.is_closing():
            transport.write(response)
            if not keep_alive:
                transport.close()
        self.on_response_complete()


def _response(status: int, content: bytes, headers: Mapping[str, str], keep_alive: bool
              ) -> bytes:
    """One whole HTTP/1.1 response, with the date line of this second."""
    parts = [_STATUS_LINE[status], _Date.lines]
    for name, text in headers.items():
        if name != "Connection":
            parts.append(_line(name, text))
    parts.append(b"content-length: %d\r\n" % len(content))
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts += (b"\r\n", content)
    return b"".join(parts)


def protocol_for(service: inference.Service) -> type[Connection]:
    """The connection class of one worker, bound to its service."""
    return type("WorkerConnection", (Connection,), {"service": service})


__all__ = ["Connection", "Exchange", "UnsupportedUvicorn", "check_uvicorn", "httptools",
           "protocol_for"]
