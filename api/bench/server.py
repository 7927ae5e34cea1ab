"""The real server under test: start ``batchserve serve``, wait until it is ready, stop it.

What the benchmark scripts share to run the server they measure; ``serve`` hands them the base
URL and the supervisor's pid, whose process tree ``batchserve.api.bench.cpu`` then reads.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Poll ``/v2/health/ready`` until it answers 200, the server dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before ready")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1.0) as response:
                if response.status == 200:
                    return
        time.sleep(0.2)
    raise RuntimeError(f"server at {url} not ready after {timeout:g} s")


def batchserve_command() -> list[str]:
    """The ``batchserve`` script next to this interpreter, else the one on PATH."""
    script = Path(sys.executable).with_name("batchserve")
    return [str(script)] if script.exists() else ["batchserve"]


@contextlib.contextmanager
def serve(args: argparse.Namespace, log: Path, *, cwd: Path,
          env: Mapping[str, str] | None = None, extra: Sequence[str] = ()
          ) -> Iterator[tuple[str, int]]:
    """Start ``batchserve serve`` in folder ``cwd`` with ``args.config``, ``args.port`` (0: a
    free one), ``args.api_workers`` (None: the file's), ``args.ready_timeout`` and ``extra``
    (``--grpc-port P``), its output to ``log``, in environment ``env`` (default: this
    process's); yield (base URL, supervisor pid); SIGTERM it after."""
    port = args.port or free_port()
    cmd = batchserve_command() + ["serve", "--config", str(args.config), "--port", str(port)]
    if args.api_workers is not None:
        cmd += ["--api-workers", str(args.api_workers)]
    cmd += extra
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    try:
        wait_ready(url, proc, args.ready_timeout)
        yield url, proc.pid
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        print(f"server {proc.pid} ignored SIGTERM for 15 s; killing it", file=sys.stderr)
        proc.kill()
        proc.wait()
