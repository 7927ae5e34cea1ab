"""A PNG of a sweep: latency percentiles and goodput against the offered rate.

matplotlib is an optional extra (``pip install 'batchserve[plot]'``), imported only here and
only when a plot is asked for, so the server never loads it.
"""

from __future__ import annotations

from pathlib import Path

from ...runner.core.pyplot import pyplot
from .report import Report

OPTION = "--plot"


def require() -> None:
    """Raise `PlotUnavailable` now, before a sweep runs, rather than after it."""
    pyplot(OPTION)


def plot(report: Report, path: Path) -> None:
    """Write the sweep's plot to ``path`` (PNG)."""
    plt = pyplot(OPTION)
    offered = [step.load.offered_rate for step in report.steps]
    fig, (lat, put) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for name, q in (("p50", "ok_p50_ms"), ("p90", "ok_p90_ms"), ("p99", "ok_p99_ms")):
        values = [getattr(step.load, q) for step in report.steps]
        lat.plot(offered, [float("nan") if v is None else v for v in values], "o-", label=name)
    lat.axhline(report.limit_ms, color="grey", linestyle="--", label=f"limit {report.limit_ms:g}")
    lat.set(xlabel="offered req/s", ylabel="latency of 2xx answers, ms", title="latency")
    lat.legend()
    put.plot(offered, offered, ":", color="grey", label="offered")
    put.plot(offered, [s.load.achieved_rate for s in report.steps], "o-", label="2xx req/s")
    put.plot(offered, [s.load.goodput for s in report.steps], "s-", label="goodput req/s")
    put.set(xlabel="offered req/s", ylabel="req/s",
            title=f"goodput within {report.limit_ms:g} ms")
    put.legend()
    fig.suptitle(f"{report.model} at {report.url} ({report.steps[0].pattern})")
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
