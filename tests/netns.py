"""Hosts of their own on one machine: Linux network namespaces on one bridge.

Each host is a namespace with its own loopback and one interface, `eth0`, at 10.77.0.N/24,
cabled by a veth pair to a bridge that lives in a namespace of its own (the switch), so
nothing is added to the machine's own network: no interface, address or route. A host's
processes run under `ip netns exec`, which also bind-mounts `/etc/netns/NS/hosts` over
`/etc/hosts` for them: the hosts file stands in for the DNS of a headless Service, and the
system resolver (`getaddrinfo`) reads it on every lookup. This process itself enters a
host's namespace for a while with `inside` (one thread at a time, by `setns`).

A partition pulls a host's cable at the switch (its bridge port down): packets to and
from it are dropped, and no connection is reset, as when a host or its network fails.
`Lookups` counts the name lookups made in a host, by inotify on its hosts file.

Needs root and iproute2; `unavailable()` says why not, for a skip. Everything made is
removed by `Network.close` (namespaces, and with them their veths and bridge; the
`/etc/netns` folders), after ending any process still inside a namespace made here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import struct
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000
IN_CLOSE_WRITE, IN_CLOSE_NOWRITE, IN_OPEN = 0x08, 0x10, 0x20  # sys/inotify.h
INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
SUBNET = "10.77.0"
NETNS_ETC = Path("/etc/netns")
_libc = ctypes.CDLL(None, use_errno=True)


def ip(*args: str) -> None:
    """Run `ip` and raise with its own words when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"bsprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except OSError as exc:
        return f"ip netns add is not permitted here ({exc})"
    with contextlib.suppress(OSError):
        ip("netns", "del", probe)
    return None


@dataclass(frozen=True)
class Host:
    """One namespace: its name and its address on the bridge."""

    netns: str
    ip: str
    port: str  # the switch's end of its cable

    @property
    def prefix(self) -> tuple[str, ...]:
        """Put before a command to run it inside this host, with its hosts file if any."""
        return ("ip", "netns", "exec", self.netns)


class Network:
    """A switch and the hosts cabled to it; `close` removes all of it."""

    def __init__(self, tag: str = "") -> None:
        self.prefix = f"bs{os.getpid()}{tag}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        ip("netns", "add", self.switch)
        self._made.append(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str, number: int) -> Host:
        """A new host `name` at 10.77.0.`number`, cabled to the switch."""
        host = Host(f"{self.prefix}-{name}", f"{SUBNET}.{number}", f"h{number}")
        ip("netns", "add", host.netns)
        self._made.append(host.netns)
        self.hosts.append(host)
        ip("link", "add", "eth0", "netns", host.netns, "type", "veth",
           "peer", "name", host.port, "netns", self.switch)
        ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        ip("-n", host.netns, "link", "set", "eth0", "up")
        ip("-n", host.netns, "link", "set", "lo", "up")
        return host

    @staticmethod
    def hosts_path(host: Host) -> Path:
        """The file `host`'s processes see as /etc/hosts, once `hosts_file` has written it."""
        return NETNS_ETC / host.netns / "hosts"

    def hosts_file(self, host: Host, names: Mapping[str, Sequence[Host]]) -> None:
        """What `host`'s processes find in /etc/hosts: each name's addresses. Written in
        place, since `ip netns exec` bind-mounted this very file (a new one would go unseen
        by processes already running)."""
        path = self.hosts_path(host)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"]
        lines += [f"{each.ip} {name}" for name, found in names.items() for each in found]
        with path.open("w") as file:
            file.write("\n".join(lines) + "\n")

    def partition(self, host: Host) -> None:
        """Pull `host`'s cable: its traffic is dropped, its connections are not reset."""
        ip("-n", self.switch, "link", "set", host.port, "down")

    def mend(self, host: Host) -> None:
        ip("-n", self.switch, "link", "set", host.port, "up")

    @contextlib.contextmanager
    def inside(self, host: Host) -> Iterator[None]:
        """Run this thread in `host`'s namespace: sockets made meanwhile belong to it."""
        with open(f"/run/netns/{host.netns}") as there, open("/proc/thread-self/ns/net") as home:
            _setns(there.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    def close(self) -> None:
        """End what still runs inside, then remove the namespaces and hosts files."""
        for netns in reversed(self._made):
            _end_processes(netns)
            with contextlib.suppress(OSError):
                ip("netns", "del", netns)
            shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
        self._made.clear()
        with contextlib.suppress(OSError):  # only if empty: it may hold others' folders
            NETNS_ETC.rmdir()


class Lookups:
    """The name lookups made in a host since its hosts file was last written, counted by
    inotify (which sees the file through the bind mount) as reads of that file: the system
    resolver (glibc's, `files` first in nsswitch.conf) opens, reads and closes it once a
    lookup. Only `hosts_file` writes it.

    A lookup counts once it has closed the file, if it opened it after the last write was
    closed: it read the new content whole. Opens are watched too, which also keeps the
    reports apart: inotify merges a report into an identical one not yet read, and a close
    is always reported after an open."""

    def __init__(self, path: Path) -> None:
        self.count = 0
        self._open = 0  # opened since the last write, not closed yet
        self._fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"inotify_init1: {os.strerror(errno)}")
        mask = IN_OPEN | IN_CLOSE_NOWRITE | IN_CLOSE_WRITE
        if _libc.inotify_add_watch(self._fd, os.fsencode(path), mask) < 0:
            errno = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(errno, f"inotify_add_watch {path}: {os.strerror(errno)}")

    def __enter__(self) -> Lookups:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def poll(self) -> int:
        """Take in what was reported so far; the lookups since the last write."""
        while True:
            try:
                data = os.read(self._fd, 4096)
            except BlockingIOError:
                return self.count
            for offset in _events(data):
                _, mask, _, _ = INOTIFY_EVENT.unpack_from(data, offset)
                if mask & IN_CLOSE_WRITE:
                    self.count = self._open = 0
                elif mask & IN_OPEN:
                    self._open += 1
                elif mask & IN_CLOSE_NOWRITE and self._open:
                    self._open -= 1
                    self.count += 1


def _events(data: bytes) -> Iterator[int]:
    """Where each inotify event starts in what one read returned."""
    offset = 0
    while offset < len(data):
        yield offset
        offset += INOTIFY_EVENT.size + INOTIFY_EVENT.unpack_from(data, offset)[3]


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def _end_processes(netns: str) -> None:
    """Kill, by pid, the processes a test left in `netns` (only ever its own)."""
    listed = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                            timeout=30, stdin=subprocess.DEVNULL)
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
