"""Start one server fresh, wait until it answers one row correctly, and stop it with its children.

Every server starts in a session of its own so stopping it reaches whatever it spawned (Ray's
raylet, mosec's workers, uvicorn's children) by the group's id, and nothing outlives a round.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from batchserve.api.bench.server import free_port
from benchmarks.peers.peer import OUTPUTS, ROOT, Peer

TOLERANCE = 1e-4
"""How far an answer may stray from the reference output (batched float32 sums reorder)."""


class WrongAnswer(RuntimeError):
    """A server answered, but not the bundled model's 16 outputs for the row."""


@dataclass(frozen=True)
class Started:
    url: str  # where one inference is POSTed
    pid: int  # the process whose tree's CPU is counted
    startup_s: float


def ask(url: str, body: bytes, timeout: float = 5.0) -> object:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def check(peer: Peer, reply: object, expected: Sequence[float]) -> None:
    """Raise :class:`WrongAnswer` unless ``reply`` holds ``expected`` within :data:`TOLERANCE`."""
    try:
        got = [float(v) for v in peer.answer(reply)]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise WrongAnswer(f"{peer.name}: no outputs in {str(reply)[:200]} ({exc!r})") from None
    worst = max((abs(g - e) for g, e in zip(got, expected, strict=False)), default=0.0)
    if len(got) != OUTPUTS or worst > TOLERANCE:
        raise WrongAnswer(f"{peer.name}: {len(got)} outputs, worst difference {worst:.2g}")


def wait_answer(
    name: str, url: str, body: bytes, proc: subprocess.Popen[bytes], timeout: float
) -> object:
    """POST `body` until the server `name` answers 200 (it is then ready), it dies, or time
    is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} before ready")
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
            return ask(url, body)
        time.sleep(0.5)
    raise RuntimeError(f"{name} gave no answer within {timeout:g} s")


@contextlib.contextmanager
def started(
    peer: Peer, body: bytes, expected: Sequence[float], log: Path
) -> Iterator[Started]:
    """``peer`` running on a free port and checked on one row; stopped (all of it) after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}{peer.path}"
    began = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            peer.argv(peer.python(), port), env=peer.environment(), cwd=ROOT,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        check(peer, wait_answer(peer.name, url, body, proc, peer.ready_timeout_s), expected)
        yield Started(url, proc.pid, time.monotonic() - began)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
