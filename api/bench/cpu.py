"""CPU time of a server's processes, read from ``/proc``: the one reader the benchmarks share.

Utime+stime from ``/proc/<pid>/stat``, keyed by pid and start time so a reused pid is not
mistaken for its predecessor. Two ways to find a server's processes: ``process_tree`` follows
parent links down from its first process; ``server_cpu`` adds the members of its session (see
there why). ``cpu_between`` turns two samples into seconds; only processes alive at both count,
so a process that exits between them takes its CPU with it, and the result says how many did.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")

ProcKey = tuple[int, int]  # (pid, start time in ticks): unique across pid reuse


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    session: int
    start: int
    cpu_ticks: int


def read_stat(pid: int) -> ProcStat | None:
    """One ``/proc/<pid>/stat``; None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or parentheses.
    fields = raw[raw.rindex(")") + 2 :].split()
    utime, stime, start = int(fields[11]), int(fields[12]), int(fields[19])
    return ProcStat(pid, int(fields[1]), int(fields[3]), start, utime + stime)


def all_stats() -> list[ProcStat]:
    """Every process in ``/proc`` still there when its stat is read."""
    return [s for p in os.listdir("/proc") if p.isdigit() and (s := read_stat(int(p)))]


def process_tree(root: int) -> list[ProcStat]:
    """``root`` and all its descendants, found by walking parent links in ``/proc``."""
    stats = all_stats()
    children: dict[int, list[ProcStat]] = {}
    for stat in stats:
        children.setdefault(stat.ppid, []).append(stat)
    tree = [s for s in stats if s.pid == root]
    for stat in tree:  # grows while iterating: a breadth-first walk
        tree.extend(children.get(stat.pid, []))
    return tree


def tree_cpu(root: int) -> dict[ProcKey, int]:
    """CPU ticks so far of ``root`` and each of its live descendants."""
    return {(s.pid, s.start): s.cpu_ticks for s in process_tree(root)}


def server_cpu(root: int) -> dict[ProcKey, int]:
    """CPU ticks so far of each live process of the server started as ``root``: its first
    process, its session, and everything they started.

    Why both the session and the parent links: every server is started in a session of its
    own, but some reparent their workers (Ray's actors outlive the raylet that forked them), and
    some start children in new sessions (batchserve's supervisor does); the union of the session
    and the descendants of all its members catches both.
    """
    stats = all_stats()
    members = {s.pid for s in stats if s.session == root or s.pid == root}
    grown = True
    while grown:  # add children of members until nothing new appears
        before = len(members)
        members |= {s.pid for s in stats if s.ppid in members}
        grown = len(members) > before
    return {(s.pid, s.start): s.cpu_ticks for s in stats if s.pid in members}


@dataclass(frozen=True)
class CpuDelta:
    seconds: float
    processes: int
    exited: int
    started: int


def cpu_between(before: dict[ProcKey, int], after: dict[ProcKey, int]) -> CpuDelta:
    """CPU spent between two samples by the processes present in both."""
    both = before.keys() & after.keys()
    ticks = sum(after[k] - before[k] for k in both)
    return CpuDelta(ticks / TICK, len(both), len(before.keys() - both), len(after.keys() - both))


def cpu_by_pid(before: dict[ProcKey, int], after: dict[ProcKey, int]) -> dict[int, float]:
    """CPU seconds between two samples, per pid, of the processes present in both."""
    tick = float(TICK)
    return {key[0]: (after[key] - before[key]) / tick for key in before.keys() & after.keys()}


def run_queue_s(pid: int) -> float:
    """Seconds the live threads of ``pid`` have spent runnable but waiting for a core (the
    second field of each ``/proc/<pid>/task/<tid>/schedstat``): how long the scheduler kept
    the process from the work it had. 0 when the process is gone; a thread that exited takes
    its share with it."""
    total = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
    return total / 1e9


def cmdline(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces; "" when it is gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return ""
