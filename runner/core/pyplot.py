"""matplotlib's pyplot, loaded only when a PNG is asked for (`batchserve bench --plot`,
`batchserve plan --png`): it is the optional `plot` extra, and no server process loads it."""

from __future__ import annotations

from typing import Any


class PlotUnavailable(Exception):
    """matplotlib is not installed."""


def pyplot(option: str) -> Any:
    """pyplot drawing to files; `PlotUnavailable` naming `option` when matplotlib is missing.
    Call it before long work too, so a missing extra is said at once, not after."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            f"{option} needs matplotlib: pip install 'batchserve[plot]'") from None
    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    return plt
