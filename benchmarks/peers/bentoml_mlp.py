"""BentoML serving the bundled MLP: one service worker, its adaptive batching at 64 rows.

Run inside ``.peers/bentoml/`` as ``bentoml serve benchmarks.peers.bentoml_mlp:MLP``; the
``MLP`` class exists only there (``bentoml`` is not importable in batchserve's venv).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from benchmarks.peers.peer import MAX_BATCH, WAIT_MS, Json, Peer


def _answer(reply: Json) -> list[float]:
    return reply[0]  # type: ignore[index, no-any-return]


def _argv(python: str, port: int) -> list[str]:
    bentoml = str(Path(python).with_name("bentoml"))
    return [bentoml, "serve", "benchmarks.peers.bentoml_mlp:MLP", "--host", "127.0.0.1",
            "--port", str(port)]


PEER = Peer(
    name="bentoml",
    packages=("bentoml",),
    path="/predict",
    body=lambda row: {"x": [row]},
    answer=_answer,
    argv=_argv,
    batching=f"@bentoml.api(batchable=True, max_batch_size={MAX_BATCH}, "
    f"max_latency_ms={WAIT_MS}), workers=1",
    env={"BENTOML_DO_NOT_TRACK": "true"},
)

with contextlib.suppress(ImportError):
    import bentoml
    import numpy as np
    import torch

    from benchmarks.peers.peer import load_mlp

    @bentoml.service(workers=1)
    class MLP:
        def __init__(self) -> None:
            self.model = load_mlp()

        @bentoml.api(batchable=True, max_batch_size=MAX_BATCH, max_latency_ms=WAIT_MS)
        def predict(self, x: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                out = self.model(torch.from_numpy(x.astype(np.float32)))  # type: ignore[operator]
            return out.numpy()  # type: ignore[no-any-return]
