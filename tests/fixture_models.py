"""Models that tests serve through real runner processes (copied next to a test config)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from batchserve.runner.core.types import PerRequest


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


def napping_echo(x: np.ndarray) -> np.ndarray:
    """Takes 40 ms a batch whatever its size, spent waiting, not computing: a server of it is
    overloaded by a few dozen requests a second, which leaves the cores to what overload
    costs (refusals and retries)."""
    time.sleep(0.04)
    return x


def busy_echo(x: np.ndarray) -> np.ndarray:
    """Takes 5 ms a batch whatever its size: a server of it is easy to overload."""
    time.sleep(0.005)
    return x


def paced_rows(x: np.ndarray) -> np.ndarray:
    """Each row's first value, after 5 ms plus 0.5 ms a row per batch spent waiting, not
    computing: the simulator's `tight_12ms` cost, leaving the cores to the front and the
    clients. The answer is one value a row, so encoding it costs the front little."""
    time.sleep(0.005 + 0.0005 * x.shape[0])
    return x[:, :1]


def steady_rows(x: np.ndarray) -> np.ndarray:
    """Each row's first value, after 3 ms plus 0.8 ms a row per batch spent waiting: a steady
    model, whose batch time never varies (`benchmarks.steady_live`)."""
    time.sleep(0.003 + 0.0008 * x.shape[0])
    return x[:, :1]


def stall_echo(x: np.ndarray) -> np.ndarray:
    """Echoes its input; a batch holding a -1 stalls for 200 ms first, one holding a -2 for a
    second (faults injected)."""
    if (x == -1).any():
        time.sleep(0.2)
    if (x == -2).any():
        time.sleep(1.0)
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
    """Echoes its input; a batch holding a -1 creates a file named `held` beside this module
    (the test sees it is in the model), then waits until a file named `gate` exists there, so
    a test decides exactly how long requests stay in flight."""
    if (x == -1).any():
        Path(__file__).with_name("held").touch()
        gate = Path(__file__).with_name("gate")
        while not gate.exists():
            time.sleep(0.01)
    return x


def _record(line: str) -> None:
    """Append one line about a batch to `batches.log` beside this module."""
    with Path(__file__).with_name("batches.log").open("a") as log:
        log.write(line + "\n")


def ragged_sums(
    tokens: np.ndarray, ends: np.ndarray, counts: np.ndarray, bounds: np.ndarray
) -> dict[str, np.ndarray]:
    """Each request's sum and length, found through the batch inputs (which must agree);
    records each batch's requests, elements and ends."""
    if not (np.array_equal(ends, np.cumsum(counts)) and np.array_equal(bounds[1:], ends)
            and bounds[0] == 0 and ends[-1] == tokens.size):
        raise ValueError(f"batch inputs disagree: {ends}, {counts}, {bounds}, {tokens.size}")
    _record(f"ragged {ends.size} {tokens.size} {' '.join(map(str, ends))}")
    sums = np.add.reduceat(tokens, bounds[:-1])
    return {"sum": sums[:, None], "length": counts[:, None].astype(np.int64)}


def slow_ragged_sums(tokens: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Each request's sum, 2 ms an element: a sequence of more than 50 elements cannot be
    run within 100 ms even on an idle model."""
    time.sleep(0.002 * tokens.size)
    return np.add.reduceat(tokens, np.concatenate(([0], ends[:-1])))[:, None]


def padded_sums(tokens: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """Each request's sum and length from a padded batch, whose padding must be -7;
    records each batch's rows, real elements and padded width."""
    real = np.arange(tokens.shape[1]) < lengths[:, None]
    if tokens.shape[1] != lengths.max() or not (tokens[~real] == -7).all():
        raise ValueError(f"bad padding: {tokens.tolist()} for lengths {lengths.tolist()}")
    _record(f"pad {tokens.shape[0]} {int(lengths.sum())} {tokens.shape[1]}")
    sums = np.where(real, tokens, 0).sum(axis=1)
    return {"sum": sums[:, None], "length": lengths[:, None].astype(np.int64)}
def tagged_batch(text: np.ndarray, tag: PerRequest) -> dict[str, np.ndarray]:
    """Tells each row its own request's `tag` (a non-batchable BYTES input, one item per
    request) and how many requests shared its batch; holds each batch 50 ms so that
    concurrent requests queue up behind it and batch together."""
    time.sleep(0.05)
    if not isinstance(tag, PerRequest) or len(tag) != len(tag.rows):
        raise TypeError(f"tag came as {type(tag).__name__}, not one item per request")
    tags = np.array([bytes(item[0]) for item in tag.per_row()] or [], dtype=object)
    return {"tag": tags, "requests": np.full(len(text), len(tag), np.int64), "echo": text}


def scaled(x: np.ndarray, *, factor: float = 1.0, shift: int = 0) -> dict[str, np.ndarray]:
    """`x * factor + shift`, for one factor and shift a batch (the runner groups by both),
    and how many rows shared the batch; holds each batch 5 ms so concurrent requests queue
    up and batch together."""
    time.sleep(0.005)
    if not isinstance(factor, int | float) or not isinstance(shift, int):
        raise TypeError(f"factor {factor!r} and shift {shift!r} must be numbers")
    rows = np.full((len(x), 1), len(x), np.int64)
    return {"y": (x * factor + shift).astype(np.float32), "rows": rows}


def doubled(x: np.ndarray) -> np.ndarray:
    """`2 x`: a first step whose answer a test can tell from its input."""
    return (2 * x).astype(np.float32)


def sleepy_echo(x: np.ndarray) -> np.ndarray:
    """Holds each batch for 1.5 s: longer than a one-second keep-alive timeout."""
    time.sleep(1.5)
    return x
