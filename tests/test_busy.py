"""The busy machine the benchmarks can run beside: real processes that spin, then are gone."""

from __future__ import annotations

import os
from pathlib import Path

from batchserve.api.bench.cpu import TICK, read_stat, run_queue_s
from benchmarks.busy import beside, busy
from tests.conftest import wait_for


def _cpu_s(pid: int) -> float:
    stat = read_stat(pid)
    assert stat is not None, f"process {pid} is gone"
    return stat.cpu_ticks / TICK


def test_busy_processes_spin_while_the_block_runs_and_are_reaped_after_it() -> None:
    with busy(2) as spinners:
        pids = [spinner.pid for spinner in spinners]
        assert len(set(pids)) == 2
        wait_for(lambda: all(_cpu_s(pid) > 0.05 for pid in pids), 30, "both to use CPU")
    assert all(spinner.returncode is not None for spinner in spinners)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_more_spinners_than_cores_wait_for_a_core_and_a_gone_process_waits_nothing() -> None:
    cores = os.cpu_count() or 1
    with busy(cores + 1) as spinners:
        pids = [spinner.pid for spinner in spinners]
        wait_for(lambda: sum(run_queue_s(pid) for pid in pids) > 0.05, 30,
                 f"{cores + 1} spinners on {cores} cores to queue for one")
    assert all(run_queue_s(pid) == 0.0 for pid in pids)


def test_busy_stops_its_processes_when_the_block_raises() -> None:
    try:
        with busy(1) as spinners:
            raise KeyError("the benchmark failed")
    except KeyError:
        pass
    assert spinners[0].returncode is not None


def test_a_report_says_what_ran_beside_it() -> None:
    assert beside(0) == ""
    assert beside(1) == " beside 1 CPU-bound process"
    assert beside(2) == " beside 2 CPU-bound processes"
