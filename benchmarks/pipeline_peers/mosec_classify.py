"""mosec serving batchserve's `classify` chain as a mosec pipeline: two stages, each a worker
of its own with its own batch size and wait, running batchserve's own `tokenize` and `text`
model code (imported through the peers' shim, `.peers/_import/`).

Stage 1 reads `{"text": "..."}` and makes the token ids; stage 2 runs the ragged text
classifier on every request's ids concatenated and answers `{"scores": [4 floats]}`. Run
inside ``.peers/mosec/`` as::

    python -m benchmarks.pipeline_peers.mosec_classify --max-batch-size 32 --max-wait-ms 2 \\
        --port PORT
"""

from __future__ import annotations

import argparse
import contextlib
import sys


def options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Ours, and the rest for mosec's own parser (port, address, log level)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=int, default=10)
    return parser.parse_known_args(argv)


with contextlib.suppress(ImportError):  # mosec exists only in its own venv
    import numpy as np
    import torch
    from mosec import Server, Worker

    from batchserve.runner.bundled import tokenize
    from batchserve.runner.text_model import RaggedText

    class Tokenize(Worker):  # type: ignore[misc]  # module level: mosec spawns it by name
        def forward(self, data: list[dict[str, str]]) -> list[np.ndarray]:
            texts = np.array([item["text"].encode() for item in data], dtype=object)
            return tokenize(texts)["tokens"]

    class Classify(Worker):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.set_num_threads(1)  # as batchserve's `text` runner (threads: 1)
            self.model = RaggedText()

        def forward(self, data: list[np.ndarray]) -> list[dict[str, list[float]]]:
            tokens = torch.from_numpy(np.concatenate(data))
            offsets = torch.from_numpy(np.cumsum([len(ids) for ids in data]))
            with torch.inference_mode():
                scores = self.model(tokens, offsets)
            return [{"scores": row} for row in scores.tolist()]


def main() -> None:
    ours, rest = options(sys.argv[1:])
    sys.argv = [sys.argv[0], *rest]
    server = Server()
    for worker in (Tokenize, Classify):
        server.append_worker(worker, num=1, max_batch_size=ours.max_batch_size,
                             max_wait_time=ours.max_wait_ms)
    server.run()


if __name__ == "__main__":
    main()
