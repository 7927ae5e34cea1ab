"""What the sweep needs to know of one server: how to start it and how to ask it one row.

Standard library only: a peer's module imports this inside that server's own venv, where
neither batchserve's dependencies nor the client's are installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".peers"
"""Each peer's own venv, ``.peers/<name>/``: their pins never meet batchserve's."""
SHIM = VENVS / "_import"
"""``batchserve/{runner,api}`` symlinks, so a peer venv imports the bundled model as is."""

MAX_BATCH = 64
WAIT_MS = 100
QUEUE_DELAY_MS = 10
"""The queue delay of the two peers batchserve is held against, mosec and Triton: what their
users set for a latency-bound MLP, where a 100 ms delay would hold every batch at low rates."""
FEATURES = 256
OUTPUTS = 16

Json = object


@dataclass(frozen=True)
class Peer:
    """One server under test, driven with one row of 256 float32 per request."""

    name: str
    packages: tuple[str, ...]  # what `pip install` puts in its venv, beside torch==2.13.0
    path: str  # URL path of one inference
    body: Callable[[list[float]], Json]  # the JSON body asking for one row
    answer: Callable[[Json], Sequence[float]]  # the row's 16 outputs in the JSON reply
    argv: Callable[[str, int], list[str]]  # command line, given the venv's python and a port
    batching: str  # its batching settings, in its own words
    env: Mapping[str, str] = field(default_factory=dict)
    own_venv: bool = True  # False for batchserve itself, which runs from the current venv
    ready_timeout_s: float = 180.0

    def python(self) -> str:
        return str(VENVS / self.name / "bin" / "python") if self.own_venv else sys.executable

    def environment(self) -> dict[str, str]:
        shim = [str(SHIM)] if self.own_venv else []
        paths = [*shim, str(ROOT), os.environ.get("PYTHONPATH", "")]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **self.env}


def make_shim() -> None:
    """Create :data:`SHIM` (idempotent): the import path of the bundled model in every venv."""
    package = SHIM / "batchserve"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("runner", "api"):
        link = package / name
        if not link.exists():
            link.symlink_to(ROOT / name)


def load_mlp() -> object:
    """The bundled MLP, one torch thread: the very construction batchserve's runner uses."""
    import torch

    from batchserve.runner.bundled import mlp

    torch.set_num_threads(1)
    return mlp()
