"""Triton (through PyTriton) serving the example models of `examples/models.yml`, with
batchserve's own weights, on the CPU.

Both speak the v2 protocol, so the very requests batchserve gets work here: `resnet` takes
`images` [N, 3, 224, 224] FP32 (binary tensors from a client that sends them), `encoder`
takes `tokens` [N, L] INT64. Triton's dynamic batcher joins only requests of the same shape
(ragged batching is a backend option PyTriton does not offer): sequences of one length batch
together, as the sweep sends them. The batching settings come from the command line, so a
sweep can look for Triton's best. Run inside ``.peers/triton/`` as::

    python -m benchmarks.peers.triton_examples --model resnet --max-batch-size 8 \\
        --max-wait-ms 10 --threads 2 --port PORT
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sysconfig

from benchmarks.peers.triton_mlp import free_port

MODELS = ("resnet", "encoder")

with contextlib.suppress(ImportError):  # pytriton exists only in its own venv
    import numpy as np
    import torch
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    from batchserve.runner.encoder import HIDDEN, Encoder
    from batchserve.runner.vision import CLASSES, SIZE, ResNet

    def images() -> tuple[object, list[Tensor], list[Tensor]]:
        model = ResNet()

        @batch  # type: ignore[misc]
        def infer(images: np.ndarray) -> dict[str, np.ndarray]:
            with torch.inference_mode():
                return {"scores": model(torch.from_numpy(images)).numpy()}

        return (infer, [Tensor(name="images", dtype=np.float32, shape=(3, SIZE, SIZE))],
                [Tensor(name="scores", dtype=np.float32, shape=(CLASSES,))])

    def sequences() -> tuple[object, list[Tensor], list[Tensor]]:
        model = Encoder()

        @batch  # type: ignore[misc]
        def infer(tokens: np.ndarray) -> dict[str, np.ndarray]:
            rows, length = tokens.shape
            offsets = torch.arange(1, rows + 1) * length
            with torch.inference_mode():
                out = model(torch.from_numpy(tokens.reshape(-1)), offsets)
            return {"embedding": out.numpy()}

        return (infer, [Tensor(name="tokens", dtype=np.int64, shape=(-1,))],
                [Tensor(name="embedding", dtype=np.float32, shape=(HIDDEN,))])

    def serve(args: argparse.Namespace) -> None:
        torch.set_num_threads(args.threads)
        infer, inputs, outputs = {"resnet": images, "encoder": sequences}[args.model]()
        config = TritonConfig(http_address="127.0.0.1", http_port=args.port,
                              grpc_port=free_port(), metrics_port=free_port())
        with Triton(config=config) as triton:
            triton.bind(
                model_name=args.model, infer_func=infer, inputs=inputs, outputs=outputs,
                config=ModelConfig(max_batch_size=args.max_batch_size, batcher=DynamicBatcher(
                    max_queue_delay_microseconds=args.max_wait_ms * 1000)),
            )
            triton.serve()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-wait-ms", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    serve(args)


if __name__ == "__main__":
    main()
