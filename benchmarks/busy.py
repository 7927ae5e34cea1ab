"""Other work on the machine: CPU-bound processes that run beside a benchmark.

A server rarely has its cores to itself. `busy(n)` starts n processes that spin in pure
Python at the default priority for as long as the block runs, so the same benchmark measures
a quiet machine and a busy one, where each of the server's processes gets only its fair share
of the scheduler.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

SPIN = "while True: pass"


@contextlib.contextmanager
def busy(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` CPU-bound processes for the duration of the block, stopped when it ends."""
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        spinners.extend(subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count))
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def beside(count: int) -> str:
    """The words a report puts after "measured" for a run beside `count` such processes."""
    if count == 0:
        return ""
    return f" beside {count} CPU-bound process{'es' if count > 1 else ''}"
