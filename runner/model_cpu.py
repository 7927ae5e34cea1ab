"""The CPU a model spends: its own thread's, and that of the threads it works through.

A model called on the model thread may spread its work over threads of its own (torch's
intra-op pool, a BLAS library's), which `time.thread_time` does not see: with `threads: 2`
it reads about half of what a torch model spent, and a cost curve fitted on it prices the
model at one core where it takes two. So the clock adds to the calling thread's CPU that of
every thread of the process that Python did not start, each read from its own CPU clock
(Linux makes one for any thread from its id). Which threads those are is looked up again
whenever the process's thread count changes (a pool starts within the first call that uses
it), and every `RESCAN_S` besides; a thread found counts from then on, and one that ended
keeps what it spent, so the clock never jumps.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable

RESCAN_S = 1.0


def native_threads() -> set[int]:
    """The ids of this process's threads that Python did not start (none off Linux)."""
    try:
        every = {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()
    return every - {thread.native_id for thread in threading.enumerate()}


def thread_count() -> int:
    """How many threads this process runs (its /proc directory links one subdirectory a
    thread, besides itself and its parent); -1 off Linux."""
    try:
        return os.stat("/proc/self/task").st_nlink - 2
    except OSError:
        return -1


def thread_cpu(tid: int) -> float:
    """A thread's CPU seconds, from the per-thread clock Linux derives from its id (as
    glibc's `pthread_getcpuclockid` does: the id inverted, shifted, then per-thread and
    scheduler time); OSError once the thread has ended."""
    return time.clock_gettime(((~tid) << 3) | 6)


class ModelCpu:
    """A CPU clock for the model thread: its own CPU plus its helper threads' (see above).
    Read it on the model thread only."""

    def __init__(self, threads: Callable[[], set[int]] = native_threads,
                 read: Callable[[int], float] = thread_cpu,
                 own: Callable[[], float] = time.thread_time,
                 count: Callable[[], int] = thread_count,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._threads, self._read, self._own = threads, read, own
        self._count, self._clock = count, clock
        self._last: dict[int, float] = {}  # each helper's CPU at its last reading
        self._offset = 0.0  # ended helpers' CPU, less found ones' before they were found
        self._counted = -1
        self._scanned = -math.inf

    def __call__(self) -> float:
        now, count = self._clock(), self._count()
        if count != self._counted or now - self._scanned >= RESCAN_S:
            self._counted, self._scanned = count, now
            self._rescan()
        return self._own() + self._offset + sum(self._reading(tid) for tid in self._last)

    def _reading(self, tid: int) -> float:
        try:
            self._last[tid] = self._read(tid)
        except OSError:
            pass  # it ended: what it spent stays
        return self._last[tid]

    def _rescan(self) -> None:
        found = self._threads()
        for tid in [tid for tid in self._last if tid not in found]:
            self._offset += self._last.pop(tid)
        for tid in found - self._last.keys():
            try:
                spent = self._read(tid)
            except OSError:
                continue
            self._last[tid] = spent
            self._offset -= spent
