"""The supervisor: starts runner processes, then API workers, and keeps them all alive.

Runners start first and each must answer a ping (model loaded, calibrated) before any API
worker starts. A runner whose configuration lists `addresses` runs elsewhere (`batchserve
runner`) and is not started here: the API workers connect to those addresses, and start-up
waits for the workers' liveness instead of readiness, since a runner on another host may come
later (until it does, its requests get 503). `--api-only` asserts that every runner is such.
The HTTP port and the gRPC port (`api.grpc_port`, 0 for none) are checked free and then
held here, bound with `SO_REUSEPORT` but not listening: every worker listens on each port
on a socket of its own, the kernel spreads new connections over the workers, and no other
server takes a port while a worker restarts (`batchserve.api.ports`). The server is ready once
every worker has reported serving on a pipe (before that a worker has no drain to run, and a
stop signal kills it) and the port answers. Signal handlers only note the signal; the main
loop acts on it. A child that dies is replaced; its in-flight requests were already answered
503 by the API worker that lost the connection. Every duration comes from the
configuration's `timeouts`.

Shutdown goes in order, so no request is dropped: the API workers first (they answer new
requests 503 and finish those they hold, which the runners are still serving), then the ports
are let go (once the workers have closed their sockets a new connection is refused, not left
waiting), then the runners (they finish
what is still queued). A process that outlives `timeouts.kill_after_s` is killed. The
supervisor exits 0 when every child it stopped exited 0. A second signal kills at once.
"""

from __future__ import annotations

import ctypes
import http.client
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from prometheus_client import multiprocess

from ..runner.core.config import Config
from ..runner.core.handshake import Refused, greet
from ..runner.core.security import Credentials
from ..runner.core.timeouts import Timeouts
from ..runner.core.wire import Address, FrameSocket, Ping, Pong, WireError
from . import ports

log = logging.getLogger("batchserve")
_PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """A child could not be started or did not become ready in time."""


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the supervisor dies, even by SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """One supervised process and the command that (re)starts it."""

    name: str
    command: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    address: Address | None = None
    runner: str | None = None  # the runner a runner process serves
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    failures: int = 0
    died: float | None = None
    answered: bool = False  # answered a ping since it was last started
    unanswered: int = 0  # pings in a row it has not answered since
    reports_ready: bool = False  # writes a byte to a pipe (`--ready-fd`) once serving
    _ready: int | None = None  # that pipe's read end, until the byte came

    def due(self, now: float, timeouts: Timeouts) -> bool:
        """Whether this dead child may start again: at once after a long life, and with a
        pause that doubles with each early death in a row, so a crash loop costs little."""
        if self.died is None:
            self.died = now
            lived = now - self.started
            self.failures = 0 if lived >= timeouts.stable_s else self.failures + 1
        return now - self.died >= timeouts.restart_pause(self.failures)

    def start(self) -> None:
        self.died = None
        self.answered, self.unanswered = False, 0
        command, pass_fds, write = self.command, self.pass_fds, None
        if self.reports_ready:
            self._close_ready()
            self._ready, write = os.pipe()
            os.set_blocking(self._ready, False)
            command, pass_fds = [*command, "--ready-fd", str(write)], (*pass_fds, write)
        try:
            self.process = subprocess.Popen(
                command, env=self.env, pass_fds=pass_fds, start_new_session=True,
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
            )
        finally:
            if write is not None:
                os.close(write)
        self.started = time.monotonic()

    @property
    def ready(self) -> bool:
        """Whether it has reported serving since it was last started (always, for a child
        that does not report)."""
        if self._ready is None:
            return True
        try:
            said = os.read(self._ready, 1)
        except BlockingIOError:
            return False
        if not said:  # the pipe closed unwritten: it died starting
            return False
        self._close_ready()
        return True

    def _close_ready(self) -> None:
        if self._ready is not None:
            os.close(self._ready)
            self._ready = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signum)


def probe(address: Address, timeout: float, runner: str, token: bytes | None = None) -> bool:
    """Whether a runner answers a ping after the handshake: it is loaded, calibrated and
    listening."""
    family = socket.AF_UNIX if address.scheme == "unix" else socket.AF_INET
    target: str | tuple[str, int] = address.target
    if address.scheme == "tcp":
        host, _, port = address.target.rpartition(":")
        target = (host, int(port))
    try:
        with socket.socket(family, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)
            connection.connect(target)
            frames = FrameSocket(connection)
            greet(frames, runner, token)
            frames.send(Ping(1))
            return isinstance(frames.receive(), Pong)
    except (OSError, Refused, WireError):
        return False


def http_ready(host: str, port: int, timeout: float, path: str = "/v2/health/ready") -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", path)
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


class Wake:
    """Set once, from a signal handler as well: what the supervisor's loops sleep on.

    `threading.Event.set` takes the lock its `wait` holds while it checks the flag, and a
    handler runs on the main thread between two of its bytecodes: a signal that lands there
    would wait on itself forever. A pipe's write needs no lock.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def set(self) -> None:
        try:
            os.write(self._write, b"!")
        except BlockingIOError:  # the pipe is full: set many times over already
            pass

    def wait(self, timeout: float) -> bool:
        """Sleep at most `timeout` seconds, less once set; whether it is set."""
        readable, _, _ = select.select([self._read], [], [], timeout)
        return bool(readable)


@dataclass
class Supervisor:
    config: Config
    config_path: Path
    host: str
    port: int
    api_workers: int
    grpc_port: int = 0
    runners: list[Child] = field(default_factory=list)
    apis: list[Child] = field(default_factory=list)
    signals: list[int] = field(default_factory=list)
    wake: Wake = field(default_factory=lambda: Wake())
    metrics_dir: Path | None = None
    keys: Credentials = field(default_factory=Credentials)
    grpc_hold: socket.socket | None = None

    @property
    def timeouts(self) -> Timeouts:
        return self.config.timeouts

    def run(self) -> int:
        """Serve until SIGINT or SIGTERM; the exit status of the whole server: 0 when every
        process stopped by itself, 1 when one had to be killed or start-up failed."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        with tempfile.TemporaryDirectory(prefix="batchserve-") as folder:
            try:
                listener = self._start(Path(folder))
            except StartupError as exc:
                log.error("%s", exc)
                self._stop(self.apis)
                self._stop(self.runners)
                return 1
            with listener:
                self._watch()
                log.info("batchserve stopping: draining the API workers, then the runners")
                clean = self._stop(self.apis)
            if self.grpc_hold is not None:
                self.grpc_hold.close()
            clean = self._stop(self.runners) and clean
        log.info("batchserve stopped")
        return 0 if clean else 1

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)
        self.wake.set()
        if len(self.signals) > 1:  # a second signal: no more patience
            for child in self.apis + self.runners:
                child.signal(signal.SIGKILL)

    def _environment(self, folder: Path, threads: int = 1) -> dict[str, str]:
        self.metrics_dir = folder / "metrics"
        self.metrics_dir.mkdir(exist_ok=True)
        return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
                "OMP_NUM_THREADS": str(threads)}

    def _start(self, folder: Path) -> socket.socket:
        config_arg = str(self.config_path.resolve())
        for runner in self.config.runners.values():
            if runner.addresses:  # served apart, by `batchserve runner`
                continue
            for index in range(runner.workers):
                address = Address("unix", str(folder / f"{runner.name}-{index}.sock"))
                self.runners.append(Child(
                    f"runner {runner.name}[{index}]",
                    [sys.executable, "-m", "batchserve.runner", "--config", config_arg,
                     "--runner", runner.name, "--address", str(address)],
                    self._environment(folder, runner.threads), address=address,
                    runner=runner.name,
                ))
        for child in self.runners:
            child.start()
        self._await_runners()
        listener = self._bind()
        grpc_args = []
        if self.grpc_port:
            self.grpc_hold = self._hold_grpc()
            grpc_args = ["--grpc-host", self.host, "--grpc-port", str(self.grpc_port)]
        addresses: dict[str, list[str]] = {}
        for runner in self.config.runners.values():
            addresses[runner.name] = [str(a) for a in runner.addresses] or [
                str(c.address) for c in self.runners if c.name.startswith(f"runner {runner.name}[")
            ]
        for index in range(self.api_workers):
            self.apis.append(Child(
                f"api worker {index}",
                [sys.executable, "-m", "batchserve.api.worker", "--config", config_arg,
                 "--runners", orjson.dumps(addresses).decode(), "--host", self.host,
                 "--port", str(self.port), *grpc_args],
                self._environment(folder), reports_ready=True,
            ))
        for child in self.apis:
            child.start()
        self._await_api(listener)
        return listener

    def _await_runners(self) -> None:
        limit = self.timeouts.runner_start_s
        deadline = time.monotonic() + limit
        waiting = list(self.runners)
        while waiting:
            if self.signals:
                raise StartupError("stopped by a signal while runners were starting")
            for child in list(waiting):
                if not child.alive:
                    raise StartupError(f"{child.name} exited while starting (see its log above)")
                if self._probe(child):
                    waiting.remove(child)
            if time.monotonic() > deadline:
                names = ", ".join(child.name for child in waiting)
                raise StartupError(f"{names} not ready within {limit:g} s")
            self.wake.wait(Timeouts.POLL_S)

    def _probe(self, child: Child) -> bool:
        assert child.address is not None and child.runner is not None
        return probe(child.address, self.timeouts.ping_timeout_s, child.runner, self.keys.token)

    def _bind(self) -> socket.socket:
        """Hold the HTTP port for the workers, each listening on it (`batchserve.api.ports`)."""
        try:
            held = ports.hold(self.host, self.port)
        except OSError as exc:
            raise StartupError(f"cannot listen on {self.host}:{self.port}: {exc.strerror}"
                               ) from None
        self.port = held.getsockname()[1]
        return held

    def _hold_grpc(self) -> socket.socket:
        """Hold the gRPC port for the workers, each of which binds it itself (grpcio takes no
        socket it did not open)."""
        try:
            return ports.hold(self.host, self.grpc_port)
        except OSError as exc:
            raise StartupError(f"cannot listen for gRPC on {self.host}:{self.grpc_port}: "
                               f"{exc.strerror}") from None

    def _await_api(self, listener: socket.socket) -> None:
        limit = self.timeouts.api_start_s
        deadline = time.monotonic() + limit
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        remote = any(runner.addresses for runner in self.config.runners.values())
        path = "/v2/health/live" if remote else "/v2/health/ready"
        while not (all(child.ready for child in self.apis)
                   and http_ready(host, self.port, self.timeouts.ping_timeout_s, path)):
            if self.signals:
                raise StartupError("stopped by a signal while API workers were starting")
            if not all(child.alive for child in self.apis):
                raise StartupError("an API worker exited while starting (see its log above)")
            if time.monotonic() > deadline:
                raise StartupError(f"the API did not become ready within {limit:g} s")
            self.wake.wait(Timeouts.POLL_S)
        grpc = f", grpc at {self.host}:{self.grpc_port}" if self.grpc_port else ""
        log.info("batchserve ready at http://%s:%d (pid %d)%s", self.host, self.port,
                 os.getpid(), grpc)

    def _watch(self) -> None:
        threading.Thread(target=self._ping_runners, name="pinger", daemon=True).start()
        while not self.signals:
            for child in self.runners + self.apis:
                if child.alive:
                    if child.unanswered >= self.timeouts.ping_misses:
                        log.error("%s (pid %d) stopped answering pings; killing it",
                                  child.name, child.process.pid if child.process else 0)
                        child.unanswered = 0
                        child.signal(signal.SIGKILL)
                    continue
                if child.died is None:  # seen dead for the first time
                    self._forget_gauges(child)
                if child.due(time.monotonic(), self.timeouts):
                    self._replace(child)
            self.wake.wait(Timeouts.WATCH_S)

    def _ping_runners(self) -> None:
        """On its own thread: ping every runner that has answered since it started; a runner
        that has (model loaded) and then misses `ping_misses` in a row is hung as a whole (its
        event loop blocked, the process stopped) and the main loop replaces it."""
        while not self.signals:
            for child in list(self.runners):
                if child.address is None or not child.alive:
                    continue
                if self._probe(child):
                    child.answered, child.unanswered = True, 0
                elif child.answered:
                    child.unanswered += 1
            self.wake.wait(self.timeouts.ping_period_s)

    def _forget_gauges(self, child: Child) -> None:
        """Drop a dead child's live gauges at once, not after its restart pause: a scrape
        must not show a dead runner's last state. Its counters stay counted."""
        if self.metrics_dir is not None and child.process is not None:
            multiprocess.mark_process_dead(  # type: ignore[no-untyped-call]
                child.process.pid, str(self.metrics_dir)
            )

    def _replace(self, child: Child) -> None:
        assert child.process is not None
        code = child.process.returncode
        child.restarts += 1
        log.warning("%s (pid %d) exited with %s; starting a replacement (restart %d)",
                    child.name, child.process.pid, code, child.restarts)
        child.start()

    def _stop(self, group: list[Child]) -> bool:
        """Signal every live child of `group` to drain and wait for them, killing any that
        outlives `kill_after_s`; whether every one exited 0 by itself."""
        running = [child for child in group if child.alive]
        for child in running:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.timeouts.kill_after_s
        clean = True
        for child in running:
            assert child.process is not None
            try:
                code = child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %g s; killing it",
                            child.name, self.timeouts.kill_after_s)
                child.process.kill()
                code = child.process.wait()
            level = logging.INFO if code == 0 else logging.WARNING
            log.log(level, "%s (pid %d) stopped with exit status %s",
                    child.name, child.process.pid, code)
            clean = clean and code == 0
        return clean
