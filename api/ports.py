"""The ports the API workers share: each worker listens on its own socket, bound with
`SO_REUSEPORT`, and the kernel spreads new connections over them.

Why not one socket that every worker accepts on: the worker that wakes first accepts every
connection waiting, so a client that opens its pool at once lands on one worker (64
connections opened together went 63 to one worker and 1 to the other), and keep-alive holds
them there for as long as the pool lives, leaving the other worker's core idle. On sockets of
their own the kernel picks the worker by a hash of each connection's addresses.

The supervisor holds each port (bound with `SO_REUSEPORT`, not listening, so it takes no
connection) from before the first worker starts until the last one has stopped: no other
server takes the port while a worker is replaced, and once the workers have closed theirs a
new connection is refused, not left waiting. A port is first checked free with a plain bind,
which fails if anyone holds it, another batchserve included.
"""

from __future__ import annotations

import socket

__all__ = ["BACKLOG", "hold", "listen"]

BACKLOG = 2048
"""Connections a worker's socket queues before it accepts them."""


def _socket(host: str, reuse_address: bool, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse_address))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
    return sock


def hold(host: str, port: int) -> socket.socket:
    """Check `port` is free (0: any free port) and hold it for the workers; OSError if it is
    taken. The held socket's `getsockname()` names the port.

    The check binds with `SO_REUSEADDR` alone: the connections of a server just stopped,
    left in TIME_WAIT, do not count, while any socket bound to the port does. The hold binds
    with `SO_REUSEPORT` alone, so another server's check finds the port taken even though no
    socket of this one listens on it yet.
    """
    check = _socket(host, reuse_address=True, reuse_port=False)
    try:
        check.bind((host, port))
        port = check.getsockname()[1]
    finally:
        check.close()
    held = _socket(host, reuse_address=False, reuse_port=True)
    try:
        held.bind((host, port))
    except OSError:
        held.close()
        raise
    return held


def listen(host: str, port: int) -> socket.socket:
    """One worker's listening socket on a port the supervisor holds."""
    sock = _socket(host, reuse_address=True, reuse_port=True)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock
