"""What an API worker's Python spends on a request it sheds at the front, and on one it takes.

    python -m benchmarks.front_refusal [--requests 20000]

One worker's real HTTP connection (`batchserve.api.http.connection`) and service, in this
process, with no socket under it: the transport keeps what is written. It feeds the bundled
`mlp`'s one-row JSON request to the connection, first while the worker sheds everything it
may (a refusal at the headers), then while it sheds nothing (the request is read, decoded and
checked, and refused only because no runner process is there). It prints the CPU of each,
per request, the best of five rounds. The socket's read and write and the event loop's wake
that a live request also costs are not in either figure: that is the floor a refusal adds to.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

import uvloop
import yaml
from uvicorn.config import Config
from uvicorn.server import ServerState

from batchserve.api.http.app import create_app
from batchserve.api.http.connection import Connection, protocol_for
from batchserve.runner.core.config import parse

CONFIG = """
runners:
  mlp:
    model: batchserve.runner.bundled:mlp
    inputs: [{name: x, datatype: FP32, shape: [-1, 256]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 16]}]
"""
BODY = (b'{"inputs":[{"name":"x","shape":[1,256],"datatype":"FP32","data":['
        + b",".join([b"0.5"] * 256) + b"]}]}")
REQUEST = (b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: 127.0.0.1\r\n"
           b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY)


class Written(asyncio.Transport):
    """A client's side that never leaves: what the connection writes, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written.append(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 3000), "peername": ("127.0.0.1", 40000)}.get(
            name, default)


def connect(app: Any) -> tuple[Connection, Written]:
    """A connection of `app`'s worker, made on the running loop, and what it writes."""
    config = Config(app=app, http="httptools", lifespan="off")
    config.load()
    connection = protocol_for(app.service)(config, ServerState(), {},
                                           _loop=asyncio.get_running_loop())
    transport = Written()
    connection.connection_made(transport)
    return connection, transport


async def measure(requests: int) -> dict[str, float]:
    """µs of CPU per request: shed at the front, and read whole."""
    app = create_app(parse(yaml.safe_load(CONFIG)), {})
    service = app.service
    connection, transport = connect(app)
    service.inflight = 1  # another request in flight: there is a backlog to shed for
    figures: dict[str, float] = {}
    for label, share in (("shed at the front", 1.0), ("read, decoded, checked", 0.0)):
        service.shedder.share, service.shedder.lag_s = share, 0.02 if share else 0.0
        best = float("inf")
        for _ in range(5):
            transport.written.clear()
            started = time.thread_time()
            for _ in range(requests):
                connection.data_received(REQUEST)
            best = min(best, (time.thread_time() - started) / requests)
        assert transport.written[-1].startswith(b"HTTP/1.1 503 "), transport.written[-1][:80]
        figures[label] = best * 1e6
    connection.connection_lost(None)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000, help="a round's requests")
    args = parser.parse_args(argv)
    for label, micros in uvloop.run(measure(args.requests)).items():
        print(f"{label}: {micros:.1f} µs of CPU a request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
