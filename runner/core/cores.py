"""The cores this process may run on: what a runner's capacity and a plan's machine start from."""

from __future__ import annotations

import os
from pathlib import Path


def usable_cores() -> float:
    """Its CPU affinity, bounded by a cgroup v2 CPU quota (a container's CPU limit)."""
    cores = float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else (
        float(os.cpu_count() or 1))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return min(cores, int(quota) / int(period))
