"""A one-line progress bar for a run of the load generator, redrawn in place on a terminal.

Only for a terminal: `batchserve bench` draws it when stderr is a TTY, so logs and pipes
get the report alone.
"""

from __future__ import annotations

from typing import TextIO

from .loadgen import Progress

WIDTH = 30


def render(label: str, progress: Progress) -> str:
    """``label [#####.....]  3.2/10 s  sent 320/1000  answered 318  ok 318``."""
    share = min(1.0, progress.elapsed_s / progress.seconds) if progress.seconds else 1.0
    filled = round(share * WIDTH)
    return (
        f"{label} [{'#' * filled}{'.' * (WIDTH - filled)}] "
        f"{min(progress.elapsed_s, progress.seconds):4.1f}/{progress.seconds:g} s  "
        f"sent {progress.fired}/{progress.scheduled}  answered {progress.answered}  "
        f"ok {progress.ok}"
    )


class ProgressBar:
    """Redraws one line of ``stream`` for each :class:`Progress` it is called with."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self._stream = stream
        self._label = label
        self._width = 0

    def __call__(self, progress: Progress) -> None:
        line = render(self._label, progress)
        self._stream.write("\r" + line.ljust(self._width))
        self._stream.flush()
        self._width = len(line)

    def close(self) -> None:
        if self._width:
            self._stream.write("\n")
            self._stream.flush()
