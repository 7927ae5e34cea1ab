"""Read the server's ``/metrics`` and turn two readings into what happened between them.

A :class:`Scrape` is one reading: every sample of every family, keyed by sample name and
labels. Counters and histogram buckets only grow while a server lives, so the difference of
two readings is what one run did. :func:`histogram_quantile` interpolates inside a bucket
the way PromQL's ``histogram_quantile`` does, so a figure here matches a Grafana panel over
the same window. It lives in the installed package because `batchserve bench` reads the
server's mean batch size and latency limit from it, as the benchmarks do.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Scrape:
    """One reading of ``/metrics``: sample name and labels to value."""

    samples: Mapping[tuple[str, Labels], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return cls(samples)

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)

    def maximum(self, name: str, **labels: str) -> float | None:
        """The largest sample named ``name`` whose labels include ``labels``; None if absent.

        For a gauge every live process repeats (one series per pid), where a sum would count
        the same value once per process.
        """
        wanted = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and wanted <= ls]
        return max(found) if found else None

    def by_label(self, name: str, key: str, **labels: str) -> dict[str, float]:
        """The samples named ``name`` matching ``labels``, summed per value of label ``key``."""
        wanted = set(labels.items())
        out: dict[str, float] = {}
        for (n, ls), v in self.samples.items():
            if n == name and wanted <= ls:
                value = dict(ls).get(key, "")
                out[value] = out.get(value, 0.0) + v
        return out

    def buckets(self, histogram: str, **labels: str) -> dict[float, float]:
        """Cumulative bucket counts of one histogram, by upper bound (``+Inf`` as inf)."""
        raw = self.by_label(f"{histogram}_bucket", "le", **labels)
        return {float(le): count for le, count in raw.items()}


def fetch(base_url: str, timeout: float = 5.0) -> Scrape:
    """One reading of ``base_url``'s ``/metrics``; urllib's errors pass through."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as response:
        return Scrape.parse(response.read().decode())


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` per key, keeping only keys that changed."""
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: v for k, v in out.items() if v}


def bucket_delta(before: Mapping[float, float], after: Mapping[float, float]) -> dict[float, float]:
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of cumulative ``buckets``, interpolated as PromQL does.

    Linear inside the bucket that holds the rank; the first bucket starts at 0; a rank in
    the ``+Inf`` bucket gives the highest finite bound. None when there are no observations.
    """
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        raise ValueError("a histogram needs a +Inf bucket")
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower
