"""mosec serving the bundled MLP: a Rust HTTP front, one Python worker batching up to 64 rows.

Run inside ``.peers/mosec/`` as ``python -m benchmarks.peers.mosec_mlp --port PORT``.
"""

from __future__ import annotations

import contextlib

from benchmarks.peers.peer import MAX_BATCH, QUEUE_DELAY_MS, Json, Peer


def _answer(reply: Json) -> list[float]:
    return reply["y"]  # type: ignore[index, no-any-return]


PEER = Peer(
    name="mosec",
    packages=("mosec",),
    path="/inference",
    body=lambda row: {"x": row},
    answer=_answer,
    argv=lambda python, port: [python, "-m", "benchmarks.peers.mosec_mlp", "--port", str(port),
                               "--address", "127.0.0.1", "--log-level", "warning"],
    batching=f"append_worker(num=1, max_batch_size={MAX_BATCH}, "
    f"max_wait_time={QUEUE_DELAY_MS}) (ms)",
)


with contextlib.suppress(ImportError):  # mosec exists only in its own venv
    import torch
    from mosec import Server, Worker

    from benchmarks.peers.peer import load_mlp

    class MLP(Worker):  # type: ignore[misc]  # module level: mosec spawns it by name
        def __init__(self) -> None:
            super().__init__()
            self.model = load_mlp()

        def forward(self, data: list[dict[str, list[float]]]) -> list[dict[str, list[float]]]:
            with torch.inference_mode():
                out = self.model(torch.tensor([item["x"] for item in data]))  # type: ignore[operator]
            return [{"y": row} for row in out.tolist()]


def main() -> None:
    server = Server()
    server.append_worker(MLP, num=1, max_batch_size=MAX_BATCH, max_wait_time=QUEUE_DELAY_MS)
    server.run()


if __name__ == "__main__":
    main()
