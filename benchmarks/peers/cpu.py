"""CPU time of a server: its first process, its session, and everything they started.

Why both the session and the parent links: every server is started in a session of its own,
but some reparent their workers (Ray's actors outlive the raylet that forked them), and some
start children in new sessions (batchserve's supervisor does); the union of the session and
the descendants of all its members catches both. Read from ``/proc`` like
``benchmarks/load.py``, keyed by pid and start time so a reused pid is not counted twice.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from benchmarks.load import ProcKey


class Stat(NamedTuple):
    pid: int
    ppid: int
    session: int
    start: int
    ticks: int  # utime + stime


def _stat(pid: str) -> Stat | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    ppid, session, start = int(fields[1]), int(fields[3]), int(fields[19])
    return Stat(int(pid), ppid, session, start, int(fields[11]) + int(fields[12]))


def server_cpu(root: int) -> dict[ProcKey, int]:
    """CPU ticks so far of each live process of the server started as ``root``."""
    stats = [s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid))]
    members = {s.pid for s in stats if s.session == root or s.pid == root}
    grown = True
    while grown:  # add children of members until nothing new appears
        before = len(members)
        members |= {s.pid for s in stats if s.ppid in members}
        grown = len(members) > before
    return {(s.pid, s.start): s.ticks for s in stats if s.pid in members}
