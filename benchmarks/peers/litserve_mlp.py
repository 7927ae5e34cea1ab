"""LitServe serving the bundled MLP: its uvicorn front, one inference worker, batches of 64.

Run inside ``.peers/litserve/`` as ``python -m benchmarks.peers.litserve_mlp --port PORT``.
"""

from __future__ import annotations

import argparse
import contextlib

from benchmarks.peers.peer import MAX_BATCH, WAIT_MS, Json, Peer


def _answer(reply: Json) -> list[float]:
    return reply["y"]  # type: ignore[index, no-any-return]


PEER = Peer(
    name="litserve",
    packages=("litserve",),
    path="/predict",
    body=lambda row: {"x": row},
    answer=_answer,
    argv=lambda python, port: [python, "-m", "benchmarks.peers.litserve_mlp", "--port", str(port)],
    batching=f"max_batch_size={MAX_BATCH}, batch_timeout={WAIT_MS / 1000:g} (s), "
    "workers_per_device=1",
)


with contextlib.suppress(ImportError):  # litserve exists only in its own venv
    import litserve as ls
    import torch

    from benchmarks.peers.peer import load_mlp

    class MLP(ls.LitAPI):  # type: ignore[misc]  # module level: its worker is spawned
        def setup(self, device: str) -> None:
            self.model = load_mlp()

        def decode_request(self, request: dict[str, list[float]]) -> list[float]:
            return request["x"]

        def batch(self, rows: list[list[float]]) -> torch.Tensor:
            return torch.tensor(rows)

        def predict(self, x: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return self.model(x)  # type: ignore[operator, no-any-return]

        def unbatch(self, output: torch.Tensor) -> list[list[float]]:
            return output.tolist()  # type: ignore[no-any-return]

        def encode_response(self, row: list[float]) -> dict[str, list[float]]:
            return {"y": row}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    api = MLP(max_batch_size=MAX_BATCH, batch_timeout=WAIT_MS / 1000)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=port, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
