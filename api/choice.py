"""Which of a runner's connected processes takes a request: the `choice` of its configuration.

- `random` (the default): one uniformly at random. Cheap and fair when the processes are
  alike and the requests many.
- `least_loaded_of_two`: two distinct processes at random, and of those the one with fewer
  requests in flight from this API worker (the first drawn on a tie). A process that runs
  slow (a busy host, a partition not yet noticed) piles up calls and is then passed over,
  while one look at two counts keeps the choice as cheap as the random one, and the
  workers that choose at once do not all herd onto the same least-loaded process as they
  would if each took the least loaded of all.

The load is what one API worker sees (its own calls in flight), not the runner's queue: it
needs no message from the runner and is never stale. Pure functions of how many candidates
there are, their loads and a random source, so tests give a seeded `random.Random`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..runner.core.config import Choice

Load = Callable[[int], int]
"""The requests in flight to candidate `i`."""
Chooser = Callable[[int, Load, random.Random], int]
"""`(n, load, rng)` to the index of the candidate, of `n` (at least one), that is chosen."""


def uniform(n: int, load: Load, rng: random.Random) -> int:
    """One candidate uniformly at random (the load is not looked at)."""
    return 0 if n == 1 else rng.randrange(n)


def least_loaded_of_two(n: int, load: Load, rng: random.Random) -> int:
    """Of two distinct candidates drawn at random, the one with the lower load."""
    if n == 1:
        return 0
    first, second = rng.sample(range(n), 2)
    return second if load(second) < load(first) else first


CHOOSERS: dict[Choice, Chooser] = {
    "random": uniform,
    "least_loaded_of_two": least_loaded_of_two,
}
