"""Every batching policy by name: the one place the live runner and the simulator build one,
and the one a runner's configuration asks for (`build_policy`, what a runner process runs and
what the simulator runs for each step of a pipeline).

The policies' common types live in `batchserve.runner.policy.base`, which knows none of them;
this module knows them all, so neither imports the other in a circle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.runner_config import RunnerConfig
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


def build_policy(runner: RunnerConfig) -> Policy:
    """The policy a runner process runs: the adaptive policy when batching is on; one
    request at a time when it is off."""
    batching = runner.batching
    latency_s = batching.max_latency_ms / 1000
    if not batching.enabled:
        return make_policy("none", runner.max_cost, latency_s)
    if runner.layout == "rows":
        return make_policy("adaptive", batching.max_batch_size, latency_s,
                           refuse=batching.refuse)
    # Sized in elements, capped in elements and, by max_batch_size, in requests.
    return make_policy(
        "adaptive", runner.max_cost, latency_s, max_requests=batching.max_batch_size,
        refuse=batching.refuse,
    )
