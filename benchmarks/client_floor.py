"""How late a client itself makes answers that a server sends in time.

    python -m benchmarks.client_floor [--delay-ms 45] [--seconds 20] [--loads 0.8,1.5]
        [--doc docs/dispatcher-results.md]

The live check on a steady model (`benchmarks.steady_live`) passes a row when at most 0.1% of
the requests are answered after the 50 ms limit by the client's clock, which starts at each
request's scheduled send time. What the client adds (its send lag, its reading of answers on
the same event loop, and the CPU it shares with the server) is inside that clock. This gives
its floor: a bare server (uvicorn with httptools, two workers, as batchserve's API workers
run) answers every request exactly ``--delay-ms`` after reading it, with no model and no
runner, and each shared client drives it at the steady check's rates. Every answer leaves the
server ``limit - delay`` before the limit; whatever a client counts past the limit it added
itself. batchserve answers most requests well before the limit, so a share here says how
many answers sent within the last ``limit - delay`` a client would still count late.

About a minute and a half with the defaults; run it under the bench lock on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchserve.api.bench.server import free_port
from benchmarks.live_clients import RunResult, SharedClient
from benchmarks.live_table import replace_block
from benchmarks.steady_live import CAPACITY_RPS, CLIENTS, LATE_SHARE, LIMIT_MS, LOADS

ROOT = Path(__file__).resolve().parent.parent
DELAY_ENV = "BATCHSERVE_FLOOR_DELAY_S"
ANSWER = (b'{"model_name":"steady","outputs":[{"name":"y","datatype":"FP32","shape":[1,1],'
          b'"data":[0.0]}]}')
DOC_START = "<!-- client-floor: start -->"
DOC_END = "<!-- client-floor: end -->"
HEADERS = [(b"content-type", b"application/json"),
           (b"content-length", str(len(ANSWER)).encode())]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Read the request whole, wait the delay, answer a fixed 200."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await asyncio.sleep(float(os.environ[DELAY_ENV]))
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


@contextmanager
def bare_server(delay_s: float, workers: int = 2) -> Iterator[str]:
    """`app` under uvicorn on a free port, until the block ends."""
    port = free_port()
    env = {**os.environ, DELAY_ENV: f"{delay_s}"}
    command = [sys.executable, "-m", "uvicorn", "benchmarks.client_floor:app", "--port",
               str(port), "--workers", str(workers), "--http", "httptools", "--loop", "uvloop",
               "--log-level", "warning", "--no-access-log"]
    server = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        wait_listening(port)
        yield f"http://127.0.0.1:{port}/v2/models/steady/infer"
    finally:
        server.terminate()
        server.wait(timeout=30)


def wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the bare server did not listen on {port} within {timeout_s:g} s")


def row(load: float, result: RunResult) -> str:
    late = result.late
    return (f"| {result.client} | {load:g}x | {result.sent:,} | "
            f"{'-' if late is None else f'{100 * late:.2f}'} | "
            f"{'-' if result.p99_ms is None else f'{result.p99_ms:.1f}'} | "
            f"{'-' if result.send_lag_p99_ms is None else f'{result.send_lag_p99_ms:.1f}'} | "
            f"{'PASS' if late is not None and late <= LATE_SHARE else 'MISS'} |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay-ms", type=float, default=45.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--loads", type=lambda text: tuple(float(x) for x in text.split(",")),
                   default=LOADS, help="shares of the steady model's capacity")
    p.add_argument("--shared-tools", type=Path, default=ROOT.parent / "shared/tools")
    p.add_argument("--doc", type=Path, help=f"also put the table in this file between "
                                             f"{DOC_START} and {DOC_END}")
    args = p.parse_args(argv)
    clients = [SharedClient(args.shared_tools / f"{name}.py", name=name, slo_ms=LIMIT_MS)
               for name in CLIENTS]
    lines = [f"every answer {args.delay_ms:g} ms after its request is read, limit "
             f"{LIMIT_MS:g} ms; {args.seconds:g} s a run.", "",
             "| client | load | sent | late % | p99 ms | client send lag p99 ms "
             "| late ≤ 0.1% |", "|---|---|---:|---:|---:|---:|---|"]
    with bare_server(args.delay_ms / 1000) as url:
        for client in clients:  # a warm-up, not counted
            client.run(url, 100.0, 1.0, seed=999)
        for load in args.loads:
            for client in clients:
                lines.append(row(load, client.run(url, load * CAPACITY_RPS, args.seconds,
                                                  seed=1)))
                print(f"  {lines[-1]}", file=sys.stderr, flush=True)
    text = "\n".join(lines)
    print(text)
    if args.doc:
        replace_block(args.doc, text, DOC_START, DOC_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
