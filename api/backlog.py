"""Refusing in the API worker what a runner process would refuse, without asking it.

A runner process publishes with its answers how long a one-row request arriving then would
take, as its policy judges arrivals (`batchserve.runner.core.wire.Backlog`). An API worker
keeps the last word of each process it calls and lets it age: the backlog drains as the
clock runs. A request whose budget is shorter than what is left of that wait is refused here
(503, reason `backlog`; the runner would refuse it as `queue`) as soon as its headers are in,
before its body is read or decoded, and without a crossing to the runner and back.

What is left can only be less than what the runner would find: the published wait counts the
work the process held when it answered, not what came since from other workers, so a request
refused here would be refused there too; the rest the runner judges itself.

What this worker sent the process since its last word counts as well, beyond the rows the
next batch takes (the word's `next_rows`, the policy's cap then; else a full batch): those
rows queue behind the published backlog, and that many of them may still join the batch the
published wait was for. Without them a worker forwards everything between two words, and the
process, which reads only once its model is free, refuses it a batch late: a cap of 3 images
where `max_batch_size` is 16 let 13 more through a batch of 60 ms, to be refused there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..runner.core.wire import Backlog

__all__ = ["Published"]


@dataclass(slots=True)
class Published:
    """A runner process's last published word and when it was heard (monotonic seconds),
    with the rows refused here since."""

    word: Backlog = field(default_factory=lambda: Backlog(0.0))
    heard: float = -math.inf
    refused_rows: float = 0.0
    sent_rows: float = 0.0
    full_batch: int = 0
    """The process's `max_batch_size`: no batch takes more, so rows sent beyond it wait
    longer; the bound where a word does not say its `next_rows` (0, unknown: rows sent are
    not counted)."""
    least_s: float = math.inf
    """The least wait ever published: about a one-row request's time on an idle process,
    what a pipeline counts for a step even once its backlog has drained."""

    def hear(self, word: Backlog, now: float) -> None:
        self.word, self.heard, self.refused_rows, self.sent_rows = word, now, 0.0, 0.0
        if 0.0 < word.wait_s < self.least_s:
            self.least_s = word.wait_s

    def sent(self, rows: float) -> None:
        """Count `rows` this worker sent the process since it last published."""
        self.sent_rows += rows

    def expected_s(self, now: float) -> float:
        """What a one-row request sent now is predicted to take: what is left of the
        published wait, and never less than the process's time when idle (0 unknown)."""
        idle_s = self.least_s if self.least_s < math.inf else 0.0
        return max(self.left_s(now), idle_s)

    def refuse(self, rows: float) -> float:
        """Count `rows` refused here (for a request refused on its headers, the rows a
        request holds lately, `request_rows`); the time the backlog they join needs, as the
        runner would tell a client it refused (its Retry-After, before rounding)."""
        self.refused_rows += rows
        return self.word.drain_s + self.word.row_s * self.refused_rows

    def left_s(self, now: float) -> float:
        """What is left of the published wait at `now` (0 once it has drained), with the rows
        sent since beyond the next batch at the model's full speed (`row_s` each)."""
        word = self.word
        batch = word.next_rows or self.full_batch
        beyond = self.sent_rows - batch if batch else 0.0
        queued_s = word.row_s * beyond if beyond > 0.0 and word.wait_s > 0.0 else 0.0
        return max(0.0, word.wait_s + queued_s - (now - self.heard))

    def refuses(self, budget_s: float, now: float) -> bool:
        """Whether a request with `budget_s` left would be refused by the process now."""
        return self.word.wait_s > 0.0 and self.left_s(now) > budget_s
