"""Models that tests serve through real runner processes (copied next to a test config)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from batchserve.runner.types import PerRequest


def pid_echo(x: np.ndarray) -> dict[str, np.ndarray]:
    """Echoes its input and tells which runner process served each row."""
    pids = np.full((x.shape[0], 1), os.getpid(), dtype=np.int64)
    return {"echo": x, "pid": pids}


def slow_pid_echo(x: np.ndarray) -> dict[str, np.ndarray]:
    """`pid_echo` holding each batch for 300 ms: which process served a request in flight."""
    time.sleep(0.3)
    return pid_echo(x)


def paced_pid_echo(x: np.ndarray) -> dict[str, np.ndarray]:
    """`pid_echo` taking 20 ms a batch whatever its size, spent waiting, not computing: a
    runner host whose capacity does not depend on the CPU it shares."""
    time.sleep(0.02)
    return pid_echo(x)


def slow_echo(x: np.ndarray) -> np.ndarray:
    """Holds each batch for 300 ms, so requests are surely in flight when a test acts."""
    time.sleep(0.3)
    return x


def busy_echo(x: np.ndarray) -> np.ndarray:
    """Takes 5 ms a batch whatever its size: a server of it is easy to overload."""
    time.sleep(0.005)
    return x


def stall_echo(x: np.ndarray) -> np.ndarray:
    """Echoes its input; a batch holding a -1 stalls for 200 ms first (a fault injected)."""
    if (x == -1).any():
        time.sleep(0.2)
    return x


def poison_echo(x: np.ndarray) -> np.ndarray:
    """Echoes its input after 20 ms, but raises on any batch holding a 666."""
    time.sleep(0.02)
    if (x == 666).any():
        raise ValueError("666 is poison")
    return x


def hang_echo(x: np.ndarray) -> np.ndarray:
    """Echoes its input; a batch holding a -1 hangs (a minute: longer than any test waits)."""
    if (x == -1).any():
        time.sleep(60)
    return x


def gated_echo(x: np.ndarray) -> np.ndarray:
    """Echoes its input; a batch holding a -1 waits until a file named `gate` exists beside
    this module, so a test decides exactly how long requests stay in flight."""
    if (x == -1).any():
        gate = Path(__file__).with_name("gate")
        while not gate.exists():
            time.sleep(0.01)
    return x


def tagged_batch(text: np.ndarray, tag: PerRequest) -> dict[str, np.ndarray]:
    """Tells each row its own request's `tag` (a non-batchable BYTES input, one item per
    request) and how many requests shared its batch; holds each batch 50 ms so that
    concurrent requests queue up behind it and batch together."""
    time.sleep(0.05)
    if not isinstance(tag, PerRequest) or len(tag) != len(tag.rows):
        raise TypeError(f"tag came as {type(tag).__name__}, not one item per request")
    tags = np.array([bytes(item[0]) for item in tag.per_row()] or [], dtype=object)
    return {"tag": tags, "requests": np.full(len(text), len(tag), np.int64), "echo": text}
