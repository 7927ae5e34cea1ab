"""The HTTP port the API workers share: connections a client opens together are spread over
the workers, and a port someone holds, another batchserve included, is refused at start."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from batchserve.api import ports
from tests.conftest import Server, wait_for
from tests.test_supervisor import ONE_RUNNER

POOL = 64
"""Connections a client opens at once. Spread by a hash, fewer than 16 of 64 on one of two
workers comes about once in 30,000 servers."""


def _tcp(port: int) -> list[list[str]]:
    """The rows of the kernel's TCP tables for sockets on local `port`."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                rows.append(fields)
    return rows


def _established(port: int) -> set[int]:
    """The socket inodes of the established TCP connections accepted on local `port`."""
    return {int(fields[9]) for fields in _tcp(port) if fields[3] == "01"}


def _queued_for(pid: int, others: set[int], port: int) -> int:
    """Connections waiting to be accepted on the listening sockets `pid` holds and no other
    process in `others` does."""
    own = _sockets_of(pid) - set().union(*(_sockets_of(other) for other in others))
    return sum(int(fields[4].split(":")[1], 16) for fields in _tcp(port)
               if fields[3] == "0A" and int(fields[9]) in own)


def _sockets_of(pid: int) -> set[int]:
    """The socket inodes process `pid` holds open."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def test_a_pool_opened_at_once_is_spread_over_the_api_workers_even_while_one_is_busy(
        serve: object) -> None:
    # On one socket that both workers accepted on, whichever woke first took every connection
    # waiting (63 of 64 for a pool opened on an idle server), and a worker busy at that moment
    # (a long decode, a collection) got none; keep-alive then held the pool there.
    server: Server = serve(ONE_RUNNER, "--api-workers", "2")  # type: ignore[operator]
    workers = [pid for pid in server.children() if pid not in server.runners()]
    assert len(workers) == 2
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    busy, awake = workers
    os.kill(busy, signal.SIGSTOP)
    try:
        pool = [socket.create_connection((host, int(port)), timeout=30) for _ in range(POOL)]
        # Every connection accepted by the awake worker, or waiting for the busy one alone.
        wait_for(lambda: len(_sockets_of(awake) & _established(int(port)))
                 + _queued_for(busy, {awake, server.pid}, int(port)) == POOL,
                 30, "the awake worker to accept what is not the busy one's")
    finally:
        os.kill(busy, signal.SIGCONT)
    try:
        for connection in pool:  # each answered: accepted by a worker, not in a queue
            connection.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        for connection in pool:
            assert connection.recv(4096).startswith(b"HTTP/1.1 200")
        accepted = _established(int(port))
        counts = [len(_sockets_of(pid) & accepted) for pid in workers]
    finally:
        for connection in pool:
            connection.close()
    assert sum(counts) == POOL
    assert min(counts) >= 16, f"{POOL} connections opened at once went {counts}"


def test_a_port_another_server_holds_is_refused_even_with_reuse_port() -> None:
    first = ports.hold("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        with pytest.raises(OSError):
            ports.hold("127.0.0.1", port)  # another batchserve, also with SO_REUSEPORT
    finally:
        first.close()
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    try:
        with pytest.raises(OSError):
            ports.hold("127.0.0.1", plain.getsockname()[1])
    finally:
        plain.close()


def test_every_worker_listens_beside_the_held_port_and_the_hold_takes_no_connection() -> None:
    held = ports.hold("127.0.0.1", 0)
    port = held.getsockname()[1]
    with held:
        with pytest.raises(ConnectionRefusedError):  # held, but no worker listens yet
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        workers = [ports.listen("127.0.0.1", port) for _ in range(2)]
        try:
            client = socket.create_connection(("127.0.0.1", port), timeout=5)
            client.close()
        finally:
            for listener in workers:
                listener.close()
