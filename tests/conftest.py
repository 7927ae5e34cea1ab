"""Fixtures that start the real server: the `batchserve` command, real processes, sockets."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from batchserve.api.bench.cpu import process_tree

ROOT = Path(__file__).resolve().parent.parent
BATCHSERVE = str(Path(sys.executable).parent / "batchserve")
READY = re.compile(r"batchserve ready at http://([\d.]+):(\d+) \(pid (\d+)\)"
                   r"(?:, grpc at ([\d.]+:\d+))?")
START_S = 180.0


@dataclass
class Server:
    """A running `batchserve serve`, its URL and the log it has written so far."""

    process: subprocess.Popen[str]
    url: str = ""
    grpc: str = ""  # host:port of its gRPC service, when it has one
    pid: int = 0
    log: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)  # type: ignore[arg-type]

    def children(self) -> list[int]:
        """Every process below the supervisor (runners and API workers)."""
        return descendants(self.pid)

    def runners(self) -> list[int]:
        """The runner processes below the supervisor."""
        return [pid for pid in self.children() if b"\0-m\0batchserve.runner\0" in cmdline(pid)]

    def stop(self, timeout: float = 15) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        if self.reader is not None:
            self.reader.join(timeout)
        assert self.process.stderr is not None
        self.process.stderr.close()
        return code


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def descendants(pid: int) -> list[int]:
    return [stat.pid for stat in process_tree(pid) if stat.pid != pid]


def start_server(config: Path, *args: str, prefix: Sequence[str] = ()) -> Server:
    """Start `batchserve serve` on a free port and wait for its ready line; `prefix` runs it
    under another command (`ip netns exec NS`). gRPC is off unless `args` give a
    `--grpc-port` (`free_port()`): its default port, 8001, is one for the whole machine."""
    if "--grpc-port" not in args:
        args = (*args, "--grpc-port", "0")
    process = subprocess.Popen(
        [*prefix, BATCHSERVE, "serve", "--config", str(config), "--port", "0", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=config.parent,
        stdin=subprocess.DEVNULL,
    )
    server = Server(process)
    ready = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            server.log.append(line)
            match = READY.search(line)
            if match:
                server.url = f"http://{match[1]}:{match[2]}"
                server.pid = int(match[3])
                server.grpc = match[4] or ""
                ready.set()
        ready.set()

    server.reader = threading.Thread(target=read, daemon=True)
    server.reader.start()
    if not ready.wait(START_S) or not server.url:
        process.kill()
        server.stop()
        raise RuntimeError("server did not start:\n" + "".join(server.log))
    return server


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    """Start servers on demand; every one is stopped and checked for orphans afterwards."""
    servers: list[Server] = []

    def start(config_text: str | None = None, *args: str) -> Server:
        if config_text is None:
            config = ROOT / "configuration.yml"
        else:
            config = tmp_path / "configuration.yml"
            config.write_text(config_text)
            shutil.copy(ROOT / "tests" / "fixture_models.py", tmp_path / "fixture_models.py")
        server = start_server(config, *args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        children = server.children()
        server.stop()
        for pid in children:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            pytest.fail(f"process {pid} outlived its supervisor")


@pytest.fixture(scope="module")
def bundled() -> Iterator[Server]:
    """The bundled configuration as it is (one API worker), shared by a module's tests."""
    server = start_server(ROOT / "configuration.yml")
    yield server
    server.stop()


def free_port() -> int:
    """A TCP port nothing listens on now (for `--grpc-port`, which has no "pick one")."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
