"""Whether a request could ever be answered within its runner's latency limit, as far as the
API worker can tell: the time it takes to decode counts against the limit at every try.

Why here and not only in the runner: a JSON body of many rows can take longer to decode than
the whole limit (5,000 rows of 256 floats take some 150 ms of CPU). Answered 503 with
`Retry-After`, its client would send it again for ever. Two stages find it:

- **On arrival**, before decoding: a JSON body whose size, at the fastest rate this worker has
  decoded JSON for the runner, would take longer than the limit. Only sizes seen to be
  decoded too slowly are refused this way, so after the first such request its kind costs no
  decoding (which also holds up every other request on the worker's event loop).
- **After decoding**: a body of `LEARN_BYTES` or more whose decoding took more CPU than the
  limit (a smaller body's decoding is the fixed cost of any request). CPU time, not
  the time on the clock: a worker that waited for a core decodes no slower next time, so
  that wait is a 503 (`late`), while CPU time comes back at every try.

What decoding a body of `LEARN_BYTES` or more cost also travels to the runner (`spent_s`),
which adds it to the time the model needs at the least when it judges a request too large for
the limit. A smaller body's decoding is the fixed cost of any request, which the time kept
back for the answer (`batchserve.api.reserve`) covers: counted again, it would turn a tight
limit under load into 413s for single rows.
"""

from __future__ import annotations

import math

from .errors import TooManyRows

__all__ = ["DecodeRate", "too_slow_to_decode"]

LEARN_BYTES = 65536
"""Bodies from this size on teach the decoding rate; smaller ones cost mostly their fixed
part, which would make the rate look slower than it is."""


class DecodeRate:
    """The fastest one runner's JSON bodies have been decoded in one API worker, in CPU
    seconds a byte, learned from bodies of `LEARN_BYTES` and more."""

    __slots__ = ("seconds_per_byte",)

    def __init__(self) -> None:
        self.seconds_per_byte = math.inf

    def observe(self, size: int, cpu_s: float) -> None:
        if size >= LEARN_BYTES and cpu_s > 0.0:
            self.seconds_per_byte = min(self.seconds_per_byte, cpu_s / size)

    def least_s(self, size: int) -> float:
        """The least CPU time a JSON body of `size` bytes takes, by the fastest rate seen (0
        before any was seen)."""
        rate = self.seconds_per_byte
        return 0.0 if rate == math.inf else size * rate


def too_large_on_arrival(runner: str, size: int, least_s: float, limit_ms: float
                         ) -> TooManyRows:
    """Why a JSON body is refused before it is decoded."""
    return TooManyRows(
        f"a JSON body of {size} bytes takes at least {least_s * 1000:.1f} ms to decode for "
        f"runner {runner!r} (at the fastest rate this server has decoded its requests), over "
        f"its max_latency_ms of {limit_ms:g}; send fewer rows a request, or the tensors as "
        "binary data (the binary tensor extension), which decode far faster"
    )


def too_slow_to_decode(runner: str, cost: int, unit: str, cpu_s: float, limit_ms: float,
                       binary: bool) -> TooManyRows:
    """Why a request whose decoding alone took longer than the limit is refused, with about
    how much would fit (decoding costs in proportion to the size)."""
    most = math.floor(cost * limit_ms / (cpu_s * 1000))
    advice = f"send fewer than about {most} {unit} a request" if most else "raise the limit"
    if not binary:
        advice += ", or the tensors as binary data (the binary tensor extension)"
    return TooManyRows(
        f"{cost} {unit} took {cpu_s * 1000:.1f} ms of CPU to decode for runner {runner!r}, "
        f"over its max_latency_ms of {limit_ms:g} before its model runs; {advice}"
    )
