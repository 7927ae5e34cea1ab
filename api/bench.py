"""`batchserve bench`: drive a v2 infer endpoint with open-loop load and print what it measured.

Why apart from `batchserve.api.loadgen`: the generator knows HTTP/1.1 and Poisson arrivals but
nothing of the Open Inference Protocol; this module builds the v2 request body it sends (JSON or
binary tensors, the way `tritonclient.http` would) and is the command line around it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import numpy as np
import orjson

from batchserve.api.loadgen import LoadResult, loop_factory, run_load


def infer_body(
    rows: int,
    features: int,
    *,
    binary: bool,
    input_name: str = "x",
    output_name: str = "y",
    seed: int = 0,
) -> tuple[bytes, dict[str, str]]:
    """A v2 infer request with an FP32 ``[rows, features]`` input, as JSON or binary tensors.

    The binary form is the v2 binary tensor data extension as ``tritonclient.http`` sends it:
    a JSON header whose length is in ``Inference-Header-Content-Length``, then raw
    little-endian float32 bytes; the output is requested as binary too.
    """
    data = np.random.default_rng(seed).standard_normal((rows, features), dtype=np.float32)
    tensor: dict[str, object] = {"name": input_name, "datatype": "FP32", "shape": [rows, features]}
    if not binary:
        tensor["data"] = data.ravel().tolist()
        body = orjson.dumps({"inputs": [tensor], "outputs": [{"name": output_name}]})
        return body, {"Content-Type": "application/json"}
    raw = data.astype("<f4").tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    output = {"name": output_name, "parameters": {"binary_data": True}}
    header = orjson.dumps({"inputs": [tensor], "outputs": [output]})
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + raw, headers


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="batchserve bench",
        description="Open-loop Poisson load against a v2 infer endpoint.",
    )
    p.add_argument("--url", default="http://127.0.0.1:3000", help="server base URL")
    p.add_argument("--rate", type=float, default=100.0, help="target requests per second")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of the load")
    p.add_argument("--binary", action="store_true", help="use the v2 binary tensor extension")
    p.add_argument("--rows", type=int, default=1, help="rows per request (batch dimension)")
    p.add_argument("--features", type=int, default=256, help="features per row")
    p.add_argument("--model", default="mlp", help="model (runner) name")
    p.add_argument("--input", default="x", help="input tensor name")
    p.add_argument("--output", default="y", help="output tensor name")
    p.add_argument("--connections", type=int, default=256, help="connection pool cap")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival schedule")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(argv)


def format_result(result: LoadResult) -> str:
    """A few human-readable lines for the terminal."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    errors = ", ".join(f"{k}: {v:.2%}" for k, v in result.error_fraction.items()) or "none"
    return "\n".join(
        [
            f"target {result.target_rate:g} req/s for {result.seconds:g} s: sent {result.sent}, "
            f"ok {result.ok}, achieved {result.achieved_rate:.1f} req/s",
            f"latency ms  p50 {ms(result.p50_ms)}  p90 {ms(result.p90_ms)}  "
            f"p99 {ms(result.p99_ms)}  max {ms(result.max_ms)}",
            f"errors {result.errors:.2%} ({errors})",
            f"client: timer lag p99 {ms(result.timer_lag_p99_ms)} ms, "
            f"peak connections {result.peak_connections}, peak queued {result.peak_queued}, "
            f"CPU {result.loadgen_cpu_ms_per_req:.3f} ms/req",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``batchserve bench``: drive a v2 infer endpoint and print what it measured."""
    args = _parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.rows < 1 or args.connections < 1:
        print(
            "batchserve bench: --rate, --seconds, --rows, --connections must be positive",
            file=sys.stderr,
        )
        return 2
    body, headers = infer_body(
        args.rows,
        args.features,
        binary=args.binary,
        input_name=args.input,
        output_name=args.output,
        seed=args.seed,
    )
    url = f"{args.url.rstrip('/')}/v2/models/{args.model}/infer"
    load = run_load(url, body, headers, args.rate, args.seconds, args.seed, args.connections)
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            result = runner.run(load)
    except ValueError as exc:
        print(f"batchserve bench: {exc}", file=sys.stderr)
        return 2
    print(orjson.dumps(result.as_dict()).decode() if args.json else format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
