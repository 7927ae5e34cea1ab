"""The supervisor's restart rule (at once after a long life, backing off in a crash loop), and
what its readiness means."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from batchserve.api.supervisor import Child, Wake
from batchserve.runner.core.timeouts import Timeouts
from tests.conftest import Server, wait_for

TIMEOUTS = Timeouts()
STABLE_S = TIMEOUTS.stable_s


def child_started_at(when: float) -> Child:
    return Child("runner m[0]", ["true"], {}, started=when)


def test_restart_pauses_double_and_are_capped() -> None:
    pauses = [TIMEOUTS.restart_pause(n) for n in range(9)]
    assert pauses == [0.0, 0.5, 1, 2, 4, 8, 16, 30, 30]


def test_restart_pauses_follow_the_configured_timeouts() -> None:
    timeouts = Timeouts(restart_first_s=2.0, restart_max_s=5.0)
    assert [timeouts.restart_pause(n) for n in range(5)] == [0.0, 2.0, 4.0, 5.0, 5.0]


def test_a_child_that_lived_long_is_restarted_at_once() -> None:
    child = child_started_at(0.0)
    assert child.due(STABLE_S + 1, TIMEOUTS)
    assert child.failures == 0


def test_early_deaths_in_a_row_back_off_and_a_long_life_resets() -> None:
    child = child_started_at(0.0)
    assert not child.due(1.0, TIMEOUTS)  # died after 1 s: first early death, wait 0.5 s
    assert child.due(1.5, TIMEOUTS)
    child.died, child.started = None, 1.5  # what start() leaves behind
    assert not child.due(2.0, TIMEOUTS)  # second early death: wait 1 s
    assert not child.due(2.9, TIMEOUTS) and child.due(3.0, TIMEOUTS)
    child.died, child.started = None, 3.0
    assert child.due(3.0 + STABLE_S, TIMEOUTS) and child.failures == 0


REPORTS = "import os, sys, time; fd = int(sys.argv[2]); time.sleep({sleep}); {write}"


def reporting_child(sleep: float, write: str) -> Child:
    """A child that, after `sleep` seconds, runs `write` with `fd` its readiness pipe."""
    script = REPORTS.format(sleep=sleep, write=write)
    return Child("api worker 0", [sys.executable, "-c", script], {}, reports_ready=True)


def test_a_child_is_ready_only_once_it_wrote_to_its_pipe() -> None:
    child = reporting_child(0.5, "os.write(fd, b'1'); time.sleep(5)")
    child.start()
    try:
        assert not child.ready  # still asleep: started is not serving
        wait_for(lambda: child.ready, 10, "the readiness byte")
        assert child.ready and child.alive  # read once, ready from then on
    finally:
        child.signal(signal.SIGKILL)
        assert child.process is not None
        child.process.wait(10)


def test_a_child_that_dies_starting_is_never_ready_and_a_restart_reports_anew() -> None:
    child = reporting_child(0.0, "sys.exit(3)")
    child.start()
    assert child.process is not None and child.process.wait(10) == 3
    assert not child.ready  # the pipe closed unwritten
    child.command = reporting_child(0.0, "os.write(fd, b'1')").command
    child.start()
    wait_for(lambda: child.ready, 10, "the restarted child's readiness byte")
    assert child.process.wait(10) == 0


ONE_RUNNER = """
runners:
  iris_clf:
    model: batchserve.runner.bundled:iris_classifier
    inputs: [{name: input, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: scores, datatype: FP32, shape: [-1, 3]}]
"""


def catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGTERM (`SigCgt` in its status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    raise AssertionError(f"no SigCgt for pid {pid}")


def test_ready_means_every_api_worker_drains_a_stop_signal(serve: object) -> None:
    # Ready used to mean one worker answered on the shared port; a stop signal at that moment
    # killed a worker still starting (exit status -15, and the server's 1).
    for _ in range(3):
        server: Server = serve(ONE_RUNNER, "--api-workers", "4")  # type: ignore[operator]
        workers = [pid for pid in server.children() if pid not in server.runners()]
        assert len(workers) == 4
        assert all(catches_sigterm(pid) for pid in workers)
        assert server.stop() == 0, "".join(server.log)


def test_a_signal_handler_wakes_the_supervisor_without_a_lock() -> None:
    wake = Wake()
    assert not wake.wait(0.0)
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: wake.set())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert wake.wait(30.0)  # woken by the handler, long before the timeout
        assert wake.wait(0.0)  # and it stays set
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
