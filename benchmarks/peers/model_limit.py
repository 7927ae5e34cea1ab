"""The model's own ceiling: samples per second of the bundled MLP offline, per batch size.

No server, no HTTP, no JSON: the forward pass alone on one torch thread, the way every server
in the sweep runs it. A server's throughput over this is how much of the model it delivers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from benchmarks.peers.peer import FEATURES, load_mlp

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def samples_per_second(batch_sizes: Sequence[int] = BATCH_SIZES, seconds: float = 1.0
                       ) -> dict[int, float]:
    """Per batch size, rows per second of forward passes repeated for about ``seconds``."""
    import torch

    model = load_mlp()
    rates = {}
    with torch.inference_mode():
        for size in batch_sizes:
            x = torch.randn(size, FEATURES)
            for _ in range(3):
                model(x)  # type: ignore[operator]
            passes, began = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - began) < seconds:
                model(x)  # type: ignore[operator]
                passes += 1
            rates[size] = passes * size / elapsed
    return rates


def reference(row: list[float]) -> list[float]:
    """The model's 16 outputs for ``row``: what every server must answer."""
    import torch

    with torch.inference_mode():
        out: list[float] = load_mlp()(torch.tensor([row]))[0].tolist()  # type: ignore[operator]
    return out
