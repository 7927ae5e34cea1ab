"""MLServer serving the bundled MLP: a custom runtime, adaptive batching at 64 rows / 100 ms.

Run inside ``.peers/mlserver/`` as ``python -m benchmarks.peers.mlserver_mlp --port PORT``:
writes its ``settings.json`` and ``model-settings.json`` into a temporary folder, then
becomes ``mlserver start`` on it (same process, so the sweep counts its CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from benchmarks.peers.peer import FEATURES, MAX_BATCH, WAIT_MS, Json, Peer


def _body(row: list[float]) -> Json:
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, FEATURES], "data": row}
    return {"inputs": [tensor]}


def _answer(reply: Json) -> list[float]:
    return reply["outputs"][0]["data"]  # type: ignore[index, no-any-return]


PEER = Peer(
    name="mlserver",
    # MLServer 1.7.1's inference-pool worker calls asyncio.get_event_loop() before it has a
    # loop, which uvloop 0.22 and later refuse: the worker dies and the model never loads.
    packages=("mlserver", "uvloop<0.22"),
    path="/v2/models/mlp/infer",
    body=_body,
    answer=_answer,
    argv=lambda python, port: [python, "-m", "benchmarks.peers.mlserver_mlp", "--port", str(port)],
    batching=f"model-settings: max_batch_size={MAX_BATCH}, max_batch_time={WAIT_MS / 1000:g} (s),"
    " parallel_workers=1",
)

with contextlib.suppress(ImportError):
    import numpy as np
    import torch
    from mlserver import MLModel
    from mlserver.codecs import NumpyCodec
    from mlserver.types import InferenceRequest, InferenceResponse

    from benchmarks.peers.peer import load_mlp

    class MLP(MLModel):  # type: ignore[misc]
        async def load(self) -> bool:
            self._model = load_mlp()
            return True

        async def predict(self, payload: InferenceRequest) -> InferenceResponse:
            x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32)
            with torch.inference_mode():
                y = self._model(torch.from_numpy(x)).numpy()  # type: ignore[operator]
            return InferenceResponse(
                model_name=self.name, outputs=[NumpyCodec.encode_output("y", y)]
            )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    folder = Path(tempfile.mkdtemp(prefix="mlserver-mlp-"))
    settings = {"host": "127.0.0.1", "http_port": port, "grpc_port": _free_port(),
                "metrics_port": _free_port(), "parallel_workers": 1}
    model = {"name": "mlp", "implementation": "benchmarks.peers.mlserver_mlp.MLP",
             "max_batch_size": MAX_BATCH, "max_batch_time": WAIT_MS / 1000}
    (folder / "settings.json").write_text(json.dumps(settings))
    (folder / "model-settings.json").write_text(json.dumps(model))
    mlserver = str(Path(sys.executable).with_name("mlserver"))
    os.execv(mlserver, [mlserver, "start", str(folder)])


if __name__ == "__main__":
    main()
