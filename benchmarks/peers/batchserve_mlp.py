"""batchserve itself on the bundled ``configuration.yml``, the ``mlp`` runner.

The API workers (one) and the runner's batching (``max_batch_size: 64``, ``max_latency_ms:
100``, one torch thread) are the configuration file's own; nothing here changes them.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.peers.peer import FEATURES, ROOT, Json, Peer


def _body(row: list[float]) -> Json:
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, FEATURES], "data": row}
    return {"inputs": [tensor]}


def _answer(reply: Json) -> list[float]:
    return reply["outputs"][0]["data"]  # type: ignore[index, no-any-return]


def _argv(python: str, port: int) -> list[str]:
    script = str(Path(python).with_name("batchserve"))
    config = str(ROOT / "configuration.yml")
    return [script, "serve", "--config", config, "--port", str(port)]


PEER = Peer(
    name="batchserve",
    packages=(),
    path="/v2/models/mlp/infer",
    body=_body,
    answer=_answer,
    argv=_argv,
    batching="configuration.yml: max_batch_size: 64, max_latency_ms: 100 (adaptive), "
             "1 API worker",
    own_venv=False,
)
