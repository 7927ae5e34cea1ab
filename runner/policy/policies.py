"""Every batching policy by name: the one place the live runner and the simulator build one.

The policies' common types live in `batchserve.runner.policy.base`, which knows none of them;
this module knows them all, so neither imports the other in a circle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .adaptive import AdaptivePolicy
from .base import GreedyPolicy, Policy
from .baselines import BentoMLPolicy, FixedPolicy, NoBatchingPolicy

FACTORIES: dict[str, Callable[..., Policy]] = {
    "adaptive": AdaptivePolicy,
    "fixed": FixedPolicy,
    "none": NoBatchingPolicy,
    "bentoml": BentoMLPolicy,
    "greedy": lambda size, _latency: GreedyPolicy(size),
}
NAMES = tuple(FACTORIES)


def make_policy(kind: str, max_batch_size: int, max_latency_s: float, **kw: Any) -> Policy:
    """Build a policy by name. Extra keywords go to its constructor (e.g. `window_s` and
    `cap` for `fixed`)."""
    factory = FACTORIES.get(kind)
    if factory is None:
        raise ValueError(f"policy has value {kind!r}; it must be one of {', '.join(NAMES)}")
    return factory(max_batch_size, max_latency_s, **kw)
