"""CPU time of a server: its first process, its session, and everything they started.

Why both the session and the parent links: every server is started in a session of its own,
but some reparent their workers (Ray's actors outlive the raylet that forked them), and some
start children in new sessions (batchserve's supervisor does); the union of the session and
the descendants of all its members catches both. Read from ``/proc`` by
``benchmarks.load.read_stat``, keyed by pid and start time so a reused pid is not counted twice.
"""

from __future__ import annotations

import os

from benchmarks.load import ProcKey, read_stat


def server_cpu(root: int) -> dict[ProcKey, int]:
    """CPU ticks so far of each live process of the server started as ``root``."""
    stats = [s for pid in os.listdir("/proc") if pid.isdigit() and (s := read_stat(int(pid)))]
    members = {s.pid for s in stats if s.session == root or s.pid == root}
    grown = True
    while grown:  # add children of members until nothing new appears
        before = len(members)
        members |= {s.pid for s in stats if s.ppid in members}
        grown = len(members) > before
    return {(s.pid, s.start): s.cpu_ticks for s in stats if s.pid in members}
