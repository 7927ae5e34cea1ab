"""A batch's CPU counts the threads the model works through, not its calling thread alone."""

from __future__ import annotations

import threading
import time

import pytest

from batchserve.runner.model_cpu import RESCAN_S, ModelCpu


def test_a_torch_model_on_two_threads_is_charged_both() -> None:
    # With two intra-op threads, the calling thread's own clock sees about half the work:
    # OpenMP splits a matrix product between the threads whatever the cores are doing.
    torch = pytest.importorskip("torch")
    spent: dict[str, float] = {}

    def model_thread() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            a, b = torch.ones(256, 1024), torch.ones(1024, 1024)
            a @ b  # the pool starts with its first call
            clock = ModelCpu()
            cpu, own = clock(), time.thread_time()
            for _ in range(40):
                a @ b
            spent["model"], spent["own"] = clock() - cpu, time.thread_time() - own
        finally:
            torch.set_num_threads(before)

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    assert spent["model"] > 1.5 * spent["own"], spent


class Threads:
    """Helper threads and their CPU as a test sets them; the thread count is `shown`."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}
        self.ended: set[int] = set()
        self.now = 0.0
        self.shown = 0

    def found(self) -> set[int]:
        return set(self.cpu) - self.ended

    def count(self) -> int:
        return self.shown

    def read(self, tid: int) -> float:
        if tid in self.ended:
            raise OSError("no such thread")
        return self.cpu[tid]


def test_a_helper_counts_from_when_it_is_found_and_keeps_what_it_spent_once_ended() -> None:
    threads, own = Threads(), [1.0]
    clock = ModelCpu(threads.found, threads.read, lambda: own[0], threads.count,
                     lambda: threads.now)
    threads.cpu[7] = 2.0
    start = clock()
    assert start == 1.0  # the helper's CPU before it was found is not the model's
    threads.cpu[7], own[0] = 2.5, 1.25
    assert clock() - start == 0.75
    threads.cpu[8] = 9.0  # a new helper: not seen until the next look
    threads.cpu[7] = 3.0
    assert clock() - start == 1.25
    threads.now += RESCAN_S
    assert clock() - start == 1.25  # found now, it adds nothing it spent before
    threads.cpu[8] = 9.5
    threads.ended.add(7)  # ends: its 3.0 stays, whether read or looked for
    assert clock() - start == 1.75
    threads.now += RESCAN_S
    assert clock() - start == 1.75


def test_a_helper_is_looked_for_as_soon_as_the_thread_count_changes() -> None:
    # A model's pool starts inside its first call: found a second later, the calibration's
    # batches would be priced at the calling thread's CPU alone.
    threads, own = Threads(), [1.0]
    clock = ModelCpu(threads.found, threads.read, lambda: own[0], threads.count,
                     lambda: threads.now)
    start = clock()
    threads.cpu[7], threads.shown = 0.5, 1  # the pool starts: the process has a thread more
    assert clock() - start == 0.0  # found at once, counting from now
    threads.cpu[7] = 0.75
    assert clock() - start == 0.25
