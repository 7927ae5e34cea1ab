"""Triton Inference Server serving the bundled MLP through PyTriton, on the CPU.

PyTriton (pip ``nvidia-pytriton``) runs a real ``tritonserver`` whose Python backend stub
hands each dynamic batch to this process's ``infer``: Triton's C++ HTTP front and batcher,
the model in Python as in every other peer. The stub links against the interpreter's own
libpython, so ``LD_LIBRARY_PATH`` gets that interpreter's ``sysconfig`` LIBDIR before Triton
starts. Run inside ``.peers/triton/`` as ``python -m benchmarks.peers.triton_mlp --port PORT``;
``--grpc-port G`` serves Triton's own gRPC endpoint there (``with_grpc``), else on a free port.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import socket
import sysconfig

from benchmarks.peers.peer import FEATURES, MAX_BATCH, OUTPUTS, QUEUE_DELAY_MS, Json, Peer


def _body(row: list[float]) -> Json:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, FEATURES], "data": row}]}


def _answer(reply: Json) -> list[float]:
    return reply["outputs"][0]["data"]  # type: ignore[index, no-any-return]


PEER = Peer(
    name="triton",
    # PyTriton pins numpy below 2; torch is pinned beside it by the installer.
    packages=("nvidia-pytriton",),
    path="/v2/models/mlp/infer",
    body=_body,
    answer=_answer,
    argv=lambda python, port: [python, "-m", "benchmarks.peers.triton_mlp", "--port", str(port)],
    batching=f"max_batch_size={MAX_BATCH}, DynamicBatcher(max_queue_delay_microseconds="
    f"{QUEUE_DELAY_MS * 1000})",
)


def with_grpc(port: int) -> Peer:
    """The same peer with Triton's gRPC endpoint on ``port`` (`benchmarks.grpc_cost` loads it):
    an explicit port, since the one after the HTTP port may be taken."""
    return dataclasses.replace(PEER, argv=lambda python, http: [
        *PEER.argv(python, http), "--grpc-port", str(port)])


def free_port() -> int:
    """A port nothing listens on now, as the system hands one out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


with contextlib.suppress(ImportError):  # pytriton exists only in its own venv
    import numpy as np
    import torch
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    from benchmarks.peers.peer import load_mlp

    def serve(port: int, grpc_port: int) -> None:
        model = load_mlp()

        @batch  # type: ignore[misc]
        def infer(x: np.ndarray) -> dict[str, np.ndarray]:
            with torch.inference_mode():
                return {"y": model(torch.from_numpy(x)).numpy()}  # type: ignore[operator]

        # gRPC (unless given) and metrics on ports the system picks free: the ones after the
        # HTTP port may be taken, by a server of an earlier round still letting them go.
        config = TritonConfig(http_address="127.0.0.1", http_port=port,
                              grpc_address="127.0.0.1", grpc_port=grpc_port,
                              metrics_port=free_port())
        with Triton(config=config) as triton:
            triton.bind(
                model_name="mlp",
                infer_func=infer,
                inputs=[Tensor(name="x", dtype=np.float32, shape=(FEATURES,))],
                outputs=[Tensor(name="y", dtype=np.float32, shape=(OUTPUTS,))],
                config=ModelConfig(max_batch_size=MAX_BATCH, batcher=DynamicBatcher(
                    max_queue_delay_microseconds=QUEUE_DELAY_MS * 1000)),
            )
            triton.serve()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, default=0, help="0: a free one")
    args = parser.parse_args()
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    serve(args.port, args.grpc_port or free_port())


if __name__ == "__main__":
    main()
