"""`Tuning`: every constant the adaptive policy and its latency model decide with, in one
frozen value, each with its reason."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """Every tuning constant of the adaptive policy and its latency model, in one place.

    The defaults are what docs/dispatcher.md measures; a user has no reason to change them,
    which is why the configuration file does not expose them. Tests and experiments do.
    """

    quantile_k: float = 3.0
    """Spreads above the line that a batch's high quantile sits (about its p99.9)."""
    promise_k: float = 3.3
    """The same for a promise over several batches: a little higher, for the 0.1% late target
    summed over the batches a request waits for. The most a promise keeps, where it starts,
    and where it goes back at once when an answer is late (`late_share`)."""
    promise_floor: float = 2.0
    """The fewest spreads a promise keeps however long answers come in time: on `tight_12ms`,
    a fixed 2.0 is late 0.10%, the bound."""
    late_share: float = 0.0004
    """The share of answers the reserve may spend late, well under the 0.1% bound. Each answer
    adds it to an allowance and each late one takes one off; the reserve falls below
    `promise_k` only while the allowance would cover the whole of the batch just answered
    arriving late. Lateness comes a batch at a time: at cap 256 on the grid's overloaded
    cells, one late batch is 0.2% of a run, so a reserve that fell until it saw lateness
    was late 0.10-0.29% there, where 3.3 is late under 0.05%. Batches of a few answers, as
    on tight limits, earn their allowance within a few thousand answers."""
    late_window: float = 100_000.0
    """Answers over which the allowance is earned: it decays by 1/`late_window` an answer, so
    it holds at most `late_share * late_window` (40) answers and old lateness is forgiven."""
    reserve_fall: float = 0.00026
    """Spreads the reserve falls by for each answer in time while the allowance covers a
    batch: from `promise_k` to `promise_floor` in 5,000 answers."""
    shed_alone_k: float = 0.25
    """Spreads above the line at which `refuse: oldest` judges a batch that takes every row
    there is (the heavy tail beyond the spread left out): with no younger request to take
    its place, the oldest is kept while it is likely on time, since refusing it would
    shorten the batch by one row's time only. At 0 `tight_12ms` was late 0.97%, at 0.5 it
    kept 0.988 of BentoML's goodput; 0.25 keeps 0.99 at 0.7% late."""
    shed_chain: float = 1.1
    """Batches ahead of a later batch count at this multiple of their mean when `refuse:
    oldest` judges it: its oldest request, at the edge of its promise when it becomes the
    next batch's, would otherwise be refused then, when the running batch overruns, after
    waiting most of the limit (`overload_150`: refusal wait p99 58 ms at 1, 18 ms at 1.1);
    more refuses requests a burst's end would have served (`bursts` goodput 0.991 at 1.15)."""
    shed_chain_spreads: float = 1.5
    """... or at this many spreads over their mean, if that is more: where batch times vary
    widely, the batches ahead run longer than a tenth over their mean often enough that
    requests kept on that count are refused when their batch becomes the next, after
    waiting half the limit (`replay_mlp`, spread 0.6: refusal wait p99 14.1 ms at 1.1 times the
    mean, 0 to 4.1 ms at 1.5 spreads on six seeds; at 1 spread still past BentoML's 9 ms on
    five of them). At the 5% spread of most scenarios it is 7.5%: the multiple above holds."""
    sample_window: int = 128
    """Measured batches the regression keeps."""
    stretch_window: int = 1024
    """Measured batches the stretch, its spread and its tail are read from. The tail is their
    99th percentile, which must be the contention's and not a rare stall's: a stall in 500
    batches, seen three times in 256 by chance, would set a 256-batch p99 and refuse nearly
    everything until it left the window."""
    half_life: float = 32.0
    """Batches back at which a measured batch weighs half as much as the newest."""
    min_spread: float = 0.01
    """The least relative spread a fit admits: no machine times its batches to better than 1%,
    and a spread of zero would make every promise exact."""
    max_move: float = 4.0
    """The stretch moves at most this factor per refit, and a cost shift scales the calibration
    by at most this factor: a burst of stalls moves the model a bounded step, while a lasting
    change is followed within a few refits."""
    shift_run: int = 3
    """Batches in a row beyond the high quantile, or below its mirror (mean / factor), that mean
    the machine has changed (by chance, rarer than one in a million batches)."""
    tail_quantile: float = 0.99
    """The quantile of the recent stretches, over their median, that the tail factor is read
    at: the contention's own p99, which a normal law on the MAD would understate."""
    tail_samples: int = 100
    """Recent batches it takes to read their 99th percentile. Fewer (after a start, or after a
    shift restarts the window) have only their largest to show, which one hiccup can set: a
    150 ms page fault among 0.3 ms batches made every promise 150 ms long. Until there are
    enough, the tail may rise at most `max_move`-fold above the last one read (`Fit.tail`)."""
    few_recent: int = 16
    """With fewer recent batches than this, the spread is not allowed to fall below the last;
    with fewer live ones, the calibration's batches still count in the tail."""
    longest_overruns: int = 8
    """The longest overruns of the recent batches a fit keeps: what a batch still running far
    past its prediction (a stall) is expected to run to, from the stalls this machine has
    shown."""
    calibration_weight: float = 0.1
    """Weight of each start-up timing against a measured batch, so traffic soon dominates."""
    calibration_repeats: int = 2
    """Times each calibration size is run at start-up."""
    rate_tau_s: float = 0.1
    """Time constant of the arrival-rate estimates."""
    refused_memory_s: float = 1.0
    """How far back refused rows count as the backlog a refusal's Retry-After covers: one
    second, the least Retry-After, so the backlog is what one round of retries brings back."""
    wait_memory: float = 0.05
    """Weight of the newest request in the moving average of queue wait."""
    refit_every: int = 16
    """Batches between refits, at the least ..."""
    refit_period_s: float = 0.25
    """... and seconds between them ..."""
    refit_rows: int = 64
    """... and rows measured since the last one."""
    stale_job_s: float = 10.0
    """A refit handed out and never applied (the job failed) stops blocking the next after
    this: long beside a refit's milliseconds, short beside a runner's life."""
    hold_share: float = 0.2
    """The longest hold for more rows, as a share of the latency limit."""
    hold_min_arrivals: float = 2.0
    """A hold is worth it only if at least this many requests are expected to arrive during it;
    at lower rates the batch goes out at once, so low load never waits."""
    hold_load: float = 0.5
    """The share of time the model runs that bounds the hold from both sides: one request at a
    time must keep it busy at least this much, and amortised batches less (`hold_s`)."""
    tail_share: float = 0.5
    """The most of a request's time left that the heavy tail's reserve may take."""
    stall_after: float = 3.0
    """A batch still running at this multiple of its predicted high quantile has stalled (a
    GC pause, a hung call, a descheduled thread): too far out for the contention tail, whose
    p99 the high quantile already is. It is then expected to overrun as long as the recent
    batches that overran longer did on average (`Fit.overruns`), or, if none did, to run on
    for half the time it has run, a Pareto tail's expected remainder at `TAIL_INDEX`."""
    gap_window: int = 256
    """Batches over which the model's idle wait before a batch is read: how long the loop takes
    to see a batch's end and the model thread to wake. Every batch measures it, so a busy
    spell's wait leaves the window within a few hundred batches."""
    gap_every: int = 16
    """Batches between two readings of that wait's quantile, so reading it stays cheap."""
    gap_quantile: float = 0.99
    """The quantile of that wait whose excess over the mean a promise reserves for."""


DEFAULT_TUNING = Tuning()
