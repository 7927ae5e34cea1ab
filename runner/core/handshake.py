"""The handshake that opens every runner connection: versions, names and the shared token.

    runner -> API   Hello(version, runner, max_batch_size, nonce_r)
    API -> runner   Hello(version, runner, 0, nonce_a, proof_a)
    runner -> API   Welcome(proof_r)         or Failure(HANDSHAKE, why), then close

    proof_a = HMAC-SHA256(token, "batchserve api"    | version | runner | nonce_r | nonce_a)
    proof_r = HMAC-SHA256(token, "batchserve runner" | version | runner | nonce_r | nonce_a)

The runner's fresh nonce makes the API's proof good for one connection only, so a recorded
handshake cannot be replayed; the API's nonce does the same for the runner's proof, which lets an
API worker refuse a process that answers at a runner's address without holding the token. The
two labels differ, so neither side's proof can be reflected back as the other's. Proofs are
compared in constant time. Without a token both proofs are empty, and a side that holds a token
refuses a peer that proves nothing.

These functions only build and check frames; the connections that carry them are in
`batchserve.runner.server` (runner side) and `batchserve.api.dispatch` (API side).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from .wire import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Failure,
    FailureCode,
    FrameSocket,
    Hello,
    Message,
    Welcome,
)

API_LABEL = b"batchserve api"
RUNNER_LABEL = b"batchserve runner"


class Refused(Exception):
    """The other end of a new connection cannot be trusted or understood; says why."""


def proof(token: bytes | None, label: bytes, runner: str, nonce_r: bytes, nonce_a: bytes) -> bytes:
    """One side's proof that it holds `token`, bound to this connection's two nonces."""
    if token is None:
        return b""
    name = runner.encode()
    message = b"".join((label, struct.pack("<HB", PROTOCOL_VERSION, len(name)), name,
                        nonce_r, nonce_a))
    return hmac.new(token, message, hashlib.sha256).digest()


def _matches(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)


def _same_version(hello: Hello) -> None:
    if hello.version != PROTOCOL_VERSION:
        raise Refused(f"it speaks protocol version {hello.version}; this end speaks "
                      f"{PROTOCOL_VERSION}")


def opening(runner: str, max_batch_size: int) -> Hello:
    """The runner's first frame on a new connection."""
    return Hello(PROTOCOL_VERSION, runner, max_batch_size, secrets.token_bytes(NONCE_BYTES))


def answer(first: Message, runner: str, token: bytes | None) -> Hello:
    """The API's Hello in reply to the runner's, or `Refused`: wrong version or runner."""
    if not isinstance(first, Hello):
        raise Refused(f"it opened with a {type(first).__name__} frame, not a Hello")
    _same_version(first)
    if first.runner != runner:
        raise Refused(f"it serves runner {first.runner!r}, not {runner!r}")
    nonce = secrets.token_bytes(NONCE_BYTES)
    return Hello(PROTOCOL_VERSION, runner, 0, nonce,
                 proof(token, API_LABEL, runner, first.nonce, nonce))


def admit(sent: Hello, reply: Message, token: bytes | None) -> Welcome:
    """The runner's Welcome for the API's Hello, or `Refused`: version, runner or token."""
    if not isinstance(reply, Hello):
        raise Refused(f"it sent a {type(reply).__name__} frame before its Hello")
    _same_version(reply)
    if reply.runner != sent.runner:
        raise Refused(f"it asked for runner {reply.runner!r}; this is {sent.runner!r}")
    if token is not None:
        if not reply.proof:
            raise Refused("it holds no token, and this runner requires one")
        if not _matches(proof(token, API_LABEL, sent.runner, sent.nonce, reply.nonce),
                        reply.proof):
            raise Refused("its token does not match this runner's")
    return Welcome(proof(token, RUNNER_LABEL, sent.runner, sent.nonce, reply.nonce))


def welcomed(first: Hello, sent: Hello, reply: Message, token: bytes | None) -> None:
    """Check the runner's answer to the API's Hello; `Refused` if it refused or cannot prove
    it holds the token."""
    if isinstance(reply, Failure) and reply.code == FailureCode.HANDSHAKE:
        raise Refused(f"it refused this connection: {reply.message}")
    if not isinstance(reply, Welcome):
        raise Refused(f"it answered the Hello with a {type(reply).__name__} frame")
    if token is not None and not _matches(
        proof(token, RUNNER_LABEL, sent.runner, first.nonce, sent.nonce), reply.proof
    ):
        raise Refused("it could not prove it holds the token (a process other than the "
                      "runner, or another token)")


def greet(frames: FrameSocket, runner: str, token: bytes | None) -> None:
    """The API's side of the handshake on a blocking socket (the supervisor's pings, tools).
    Raises `Refused`, or OSError when the peer goes away."""
    first = frames.receive()
    hello = answer(first, runner, token)
    frames.send(hello)
    welcomed(first, hello, frames.receive(), token)  # type: ignore[arg-type]
