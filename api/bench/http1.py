"""A minimal HTTP/1.1 client side for the load generator: one request, many times.

The generator sends the same pre-encoded request over and over and needs from each answer
only its status, so it carries its own request encoder and a response parser that reads the
status line and `Content-Length`, and of a 503 its `Retry-After` and the `reason` its body
names, and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson

RetryAfters = dict[str, dict[str, int]]
"""The Retry-After values of 503s by the reason their bodies name, counted by value:
`{"queue": {"2": 150, "3": 12}}`; `"none"` for a 503 without the header, or a reason not named."""


class ProtocolError(Exception):
    """The server sent something this minimal HTTP/1.1 parser does not handle."""


@dataclass(frozen=True)
class Target:
    """Where to connect and the exact bytes of the one request sent over and over."""

    host: str
    port: int
    request: bytes

    @classmethod
    def from_url(
        cls, url: str, body: bytes, headers: dict[str, str], method: str = "POST"
    ) -> Target:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url {url!r} must be http://HOST[:PORT]/PATH (no TLS)")
        path = parts.path or "/"
        if parts.query:
            path = f"{path}?{parts.query}"
        port = parts.port or 80
        request = encode_request(method, path, parts.netloc, headers, body)
        return cls(parts.hostname, port, request)


def encode_request(
    method: str, path: str, host: str, headers: dict[str, str], body: bytes
) -> bytes:
    """One HTTP/1.1 request as bytes; ``Host`` and ``Content-Length`` are always ours."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    reserved = {"host", "content-length"}
    lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in reserved]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class ResponseParser:
    """Incremental HTTP/1.1 response parser that keeps only the status code.

    Bodies are framed by ``Content-Length`` (what uvicorn sends for Starlette responses);
    chunked or close-delimited bodies raise :class:`ProtocolError`. When given ``samples``, the
    parser keeps there the start of the first body of each status of 300 or more: the one
    thing a user needs to see when every request fails, at no cost while they succeed. When
    given ``retries``, it counts there each 503's Retry-After by the reason its body names.
    """

    __slots__ = ("_buf", "_status", "_remaining", "keep_alive", "_samples", "_retries",
                 "_retry_after")

    SAMPLE_BYTES = 500

    def __init__(self, samples: dict[int, bytes] | None = None,
                 retries: RetryAfters | None = None) -> None:
        self._buf = bytearray()
        self._status = 0
        self._remaining = -1  # -1: waiting for the head; >= 0: body bytes still to come
        self.keep_alive = True
        self._samples = samples
        self._retries = retries
        self._retry_after = "none"  # the Retry-After of the response being read

    def feed(self, data: bytes) -> list[int]:
        """Consume bytes; return the statuses of the responses they completed."""
        self._buf += data
        done: list[int] = []
        while True:
            if self._remaining < 0 and not self._parse_head():
                return done
            if len(self._buf) < self._remaining:
                return done
            if self._status >= 300 and self._samples is not None:
                self._keep_sample()
            if self._status == 503 and self._retries is not None:
                self._count_retry()
            del self._buf[: self._remaining]
            self._remaining = -1
            done.append(self._status)

    def _keep_sample(self) -> None:
        if self._samples is not None and self._status not in self._samples:
            size = min(self._remaining, self.SAMPLE_BYTES)
            self._samples[self._status] = bytes(self._buf[:size])

    def _count_retry(self) -> None:
        assert self._retries is not None
        reason = _reason(bytes(self._buf[: self._remaining]))
        values = self._retries.setdefault(reason, {})
        values[self._retry_after] = values.get(self._retry_after, 0) + 1

    def _parse_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self._buf[:end]).split(b"\r\n")
        del self._buf[: end + 4]
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
            raise ProtocolError(f"bad status line {lines[0]!r}")
        self._status = int(status_line[1])
        self._remaining = self._body_length(lines[1:])
        return True

    def _body_length(self, header_lines: list[bytes]) -> int:
        length = -1
        self._retry_after = "none"
        for line in header_lines:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"retry-after":
                self._retry_after = value.strip().decode("latin-1")
            elif name == b"transfer-encoding":
                raise ProtocolError(f"unsupported transfer-encoding {value.strip()!r}")
            elif name == b"connection" and value.strip().lower() == b"close":
                self.keep_alive = False
        if length >= 0:
            return length
        if self._status in (204, 304) or 100 <= self._status < 200:
            return 0
        raise ProtocolError("response without Content-Length")


def _reason(body: bytes) -> str:
    """The `reason` a 503's JSON body names (batchserve's do), else "none"."""
    try:
        reason = orjson.loads(body).get("reason")
    except (orjson.JSONDecodeError, AttributeError):
        return "none"
    return reason if isinstance(reason, str) else "none"
