"""A PNG of a plan: goodput against offered rate, one curve per setting.

matplotlib is an optional extra (``pip install 'batchserve[plot]'``), imported only here and
only when a PNG is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..core.pyplot import pyplot
from .plan import Inputs, SettingPlan

OPTION = "--png"


def require() -> None:
    """Raise `PlotUnavailable` now, before the plan runs, rather than after it."""
    pyplot(OPTION)


def plot(plans: Sequence[SettingPlan], made: Inputs, target: float, runner: str,
         path: Path) -> None:
    """Goodput within the limit against offered rate; a marker at each passing rate. Points
    where the machine cannot keep up at all (saturated) are left out of the curves."""
    plt = pyplot(OPTION)
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    top = max(point.rate for p in plans for point in p.curve)
    ax.plot([0, top], [0, top], ":", color="grey", label="offered")
    for p in plans:
        shown = [point for point in p.curve if not point.saturated]
        label = f"{p.setting.processes} proc, max_batch_size {p.setting.max_batch_size}"
        line = ax.plot([q.rate for q in shown], [q.goodput_rps for q in shown], "o-",
                       markersize=3, label=f"{label}: passes to {p.passing_rps:.0f}")[0]
        ax.axvline(p.passing_rps, color=line.get_color(), linestyle="--", linewidth=0.8)
    ax.axvline(target, color="black", linewidth=0.8, label=f"target {target:.0f}")
    ax.set(xlabel="offered req/s", ylabel=f"goodput within {made.limit_ms:g} ms, req/s",
           title=f"batchserve plan: {runner} on {made.machine.cores} cores")
    ax.legend(fontsize="small")
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
