"""mosec serving the example models of `examples/models.yml`, with batchserve's own weights.

`resnet` takes one image a request as raw FP32 bytes (602,112 of them: mosec's own binary
way, a body it hands the worker as is) and answers the 1000 scores as raw FP32 bytes;
`encoder` takes `{"tokens": [...]}` and answers `{"embedding": [...]}`. The batching
settings come from the command line, so a sweep can look for mosec's best. Run inside
``.peers/mosec/`` as::

    python -m benchmarks.peers.mosec_examples --model resnet --max-batch-size 8 \\
        --max-wait-ms 10 --threads 2 --port PORT
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

MODELS = ("resnet", "encoder")
THREADS = "BATCHSERVE_PEER_THREADS"
"""How many torch threads a worker runs on: mosec's workers are processes of their own,
which see the environment of the server, not its command line."""


def options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Ours, and the rest for mosec's own parser (port, address, log level)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-wait-ms", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_known_args(argv)


with contextlib.suppress(ImportError):  # mosec exists only in its own venv
    import numpy as np
    import torch
    from mosec import Server, Worker

    from batchserve.runner.encoder import Encoder
    from batchserve.runner.vision import ResNet

    class Images(Worker):  # type: ignore[misc]  # module level: mosec spawns it by name
        def __init__(self) -> None:
            super().__init__()
            torch.set_num_threads(int(os.environ.get(THREADS, "2")))
            self.model = ResNet()

        def deserialize(self, data: bytes) -> np.ndarray:
            return np.frombuffer(data, np.float32).reshape(3, 224, 224)

        def serialize(self, data: np.ndarray) -> bytes:
            return data.tobytes()

        def forward(self, data: list[np.ndarray]) -> list[np.ndarray]:
            with torch.inference_mode():
                scores = self.model(torch.from_numpy(np.stack(data))).numpy()
            return list(scores)

    class Sequences(Worker):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.set_num_threads(int(os.environ.get(THREADS, "2")))
            self.model = Encoder()

        def forward(self, data: list[dict[str, list[int]]]) -> list[dict[str, list[float]]]:
            sequences = [torch.tensor(item["tokens"], dtype=torch.int64) for item in data]
            offsets = torch.cumsum(torch.tensor([len(s) for s in sequences]), 0)
            with torch.inference_mode():
                out = self.model(torch.cat(sequences), offsets)
            return [{"embedding": row} for row in out.tolist()]


def main() -> None:
    ours, rest = options(sys.argv[1:])
    sys.argv = [sys.argv[0], *rest]
    os.environ[THREADS] = str(ours.threads)
    worker = Images if ours.model == "resnet" else Sequences
    server = Server()
    server.append_worker(worker, num=1, max_batch_size=ours.max_batch_size,
                         max_wait_time=ours.max_wait_ms)
    server.run()


if __name__ == "__main__":
    main()
