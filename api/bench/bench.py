"""`batchserve bench`: sweep a v2 infer endpoint with open-loop load and report what it measured.

Why apart from `batchserve.api.bench.loadgen`: the generator knows HTTP/1.1 and arrival
schedules but nothing of the Open Inference Protocol; the v2 request body it sends is made from
the model's metadata (`batchserve.api.bench.requests`, JSON or binary tensors, the way
`tritonclient.http` would; or with `--protocol grpc` a `ModelInferRequest` with raw contents,
sent by `batchserve.api.bench.grpcgen` as `tritonclient.grpc` would), so any served model is
benchmarked by its name alone, over either door. This module
is the command line around it: one run per rate of the sweep, the server's own figures read
around each (`batchserve.api.bench.probe`), the report written as a table, JSON and a plot
(`report`, `plot`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import quote, urlsplit

import numpy as np
import orjson

from ...runner.core.pyplot import PlotUnavailable
from . import plot, probe, requests
from .grpcgen import run_grpc_load
from .load_result import LoadResult
from .loadgen import Progress, loop_factory, run_load
from .progress_bar import ProgressBar
from .report import Report, Step, markdown, warnings
from .scrape import Scrape
from .traffic import Pattern

Protocol = Literal["http", "grpc"]
DEFAULT_LIMIT_MS = 100.0
GRPC_PORT = 8001
"""The gRPC port `--grpc-target` defaults to on `--url`'s host: batchserve's and Triton's."""
FAILED = 1
"""Exit status when the target cannot be reached or no request at all succeeded."""
USAGE = 2


def infer_body(
    rows: int,
    features: int,
    *,
    binary: bool,
    input_name: str = "x",
    output_name: str = "y",
    seed: int = 0,
) -> tuple[bytes, dict[str, str]]:
    """A v2 infer request with an FP32 ``[rows, features]`` input, as JSON or binary tensors:
    for scripts that load the bundled `mlp` without reading its metadata.

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


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default, except for options whose help already says what None means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of rates"
        ) from None
    if not rates or not all(_positive(rate) for rate in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: every rate must be a positive number")
    return rates


def _shape(text: str) -> tuple[str, list[int]]:
    name, _, dims = text.partition("=")
    try:
        shape = [int(dim) for dim in dims.split(",")]
    except ValueError:
        shape = []
    if not name or not shape or min(shape) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=D1,D2,... with sizes >= 0")
    return name, shape


def _parameter(text: str) -> tuple[str, object]:
    key, equals, value = text.partition("=")
    if not key or not equals:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="batchserve bench",
        description="Open-loop load against a v2 infer endpoint, at one rate or a sweep of "
        "rates, reported as a table (stdout), JSON, markdown and a PNG plot.",
        formatter_class=_Formatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:3000", help="server base URL")
    p.add_argument("--model", default="mlp", help="model (runner) name")
    p.add_argument("--rate", type=float, default=100.0, help="mean requests per second")
    p.add_argument("--sweep", type=_rates, metavar="R1,R2,...",
                   help="run each of these rates in turn (replaces --rate)")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each rate's run")
    p.add_argument("--pattern", choices=get_args(Pattern), default="poisson",
                   help="arrivals: poisson (steady), burst (1 s periods: 0.25 s at 4x the rate, "
                   "then silence), step (half the rate, then 1.5x from the midpoint)")
    p.add_argument("--limit-ms", type=float,
                   help="goodput counts 2xx answers within this many ms (default: the model's "
                   f"max_latency_ms as the server's /metrics state it, else {DEFAULT_LIMIT_MS:g})")
    p.add_argument("--protocol", choices=get_args(Protocol), default="http",
                   help="the door to load: v2 over HTTP at --url, or the v2 gRPC service at "
                   "--grpc-target (ModelInfer with raw contents); metadata and /metrics are "
                   "read from --url either way")
    p.add_argument("--grpc-target", metavar="HOST:PORT",
                   help=f"the gRPC service, for --protocol grpc (default: --url's host, port "
                   f"{GRPC_PORT})")
    p.add_argument("--channels", type=int, default=1,
                   help="gRPC channels, each an HTTP/2 connection of its own, the calls are "
                   "spread over, for --protocol grpc (a tritonclient.grpc client is one)")
    p.add_argument("--binary", action="store_true",
                   help="use the v2 binary tensor extension (HTTP; gRPC is always raw)")
    p.add_argument("--rows", type=int, default=1,
                   help="rows per request, at each batchable input's batch dimension")
    p.add_argument("--elements", type=int, default=16,
                   help="elements of a ragged or pad input's sequence, and the size of any "
                   "other -1 dimension")
    p.add_argument("--shape", type=_shape, action="append", default=[], metavar="NAME=D1,D2",
                   help="send input NAME with this shape instead (repeatable)")
    p.add_argument("--parameter", type=_parameter, action="append", default=[],
                   metavar="KEY=VALUE",
                   help="a request parameter (repeatable); VALUE is read as JSON, else as a "
                   "string")
    p.add_argument("--connections", type=int, default=256, help="connection pool cap")
    p.add_argument("--seed", type=int, default=0, help="seed of the first rate's arrivals")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the report as JSON to PATH ('-' or no PATH: stdout, no table)")
    p.add_argument("--markdown", type=Path, metavar="PATH", help="write the table to PATH")
    p.add_argument("--plot", type=Path, metavar="PATH",
                   help="write a PNG of latency and goodput against offered rate "
                   "(needs the 'plot' extra)")
    return p


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments argparse cannot check alone, or None."""
    if (not all(map(_positive, (args.rate, args.seconds))) or args.rows < 1
            or args.elements < 1 or args.connections < 1 or args.channels < 1):
        return ("--rate, --seconds, --rows, --elements, --connections, --channels must be "
                "positive")
    if args.limit_ms is not None and not _positive(args.limit_ms):
        return "--limit-ms must be positive"
    if args.plot is not None:
        try:
            plot.require()
        except PlotUnavailable as exc:
            return str(exc)
    return None


def _limit(args: argparse.Namespace, reading: Scrape | None) -> tuple[float, str]:
    """The goodput limit and where it came from."""
    if args.limit_ms is not None:
        return args.limit_ms, "--limit-ms"
    stated = probe.latency_limit_ms(reading, args.model)
    if stated is not None:
        return stated, f"max_latency_ms of {args.model!r} from /metrics"
    return DEFAULT_LIMIT_MS, "default; the server's /metrics does not state the model's limit"


def _sweep(args: argparse.Namespace, base: str) -> Report:
    """One run per rate, the server's metrics read before and after each."""
    send = _sender(args, base, requests.metadata(base, args.model))
    before = probe.read(base)
    limit_ms, source = _limit(args, before)
    steps = []
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        for i, rate in enumerate(args.sweep or [args.rate]):
            bar = ProgressBar(sys.stderr, f"{rate:g} req/s") if sys.stderr.isatty() else None
            load = runner.run(send(rate, args.seed + i, limit_ms, bar))
            if bar is not None:
                bar.close()
            after = _read_after(base)
            steps.append(Step(args.pattern, load, probe.mean_batch_size(before, after, args.model),
                              probe.refusals(before, after, args.model)))
            before = after
    return Report(base, args.model, limit_ms, source, tuple(steps))


Send = Callable[[float, int, float, Callable[[Progress], None] | None],
               Coroutine[Any, Any, LoadResult]]
"""One run: given its rate, seed, goodput limit and progress bar."""


def _sender(args: argparse.Namespace, base: str, described: dict[str, object]) -> Send:
    """The run of one rate through the door `--protocol` names, its request made once."""
    shaped = {"rows": args.rows, "elements": args.elements, "seed": args.seed,
              "parameters": dict(args.parameter), "shapes": dict(args.shape)}
    if args.protocol == "grpc":
        body = requests.grpc_request(described, **shaped)
        target = args.grpc_target or f"{urlsplit(base).hostname}:{GRPC_PORT}"
        return lambda rate, seed, limit_ms, bar: run_grpc_load(
            target, body, rate, args.seconds, seed, args.channels, slo_ms=limit_ms,
            pattern=args.pattern, progress=bar)
    content, headers = requests.request_body(described, binary=args.binary, **shaped)
    url = f"{base}/v2/models/{quote(args.model, safe='')}/infer"
    return lambda rate, seed, limit_ms, bar: run_load(
        url, content, headers, rate, args.seconds, seed, args.connections, slo_ms=limit_ms,
        pattern=args.pattern, progress=bar)


def _read_after(base: str) -> Scrape | None:
    """The metrics after a run; a server gone by then costs the batch size, not the run."""
    try:
        return probe.read(base)
    except probe.Unreachable:
        return None


def _write(args: argparse.Namespace, report: Report) -> None:
    table = markdown(report)
    if args.json == "-":
        print(report.as_json().decode())
    else:
        print(table, end="")
        if args.json is not None:
            Path(args.json).write_bytes(report.as_json())
    if args.markdown is not None:
        args.markdown.write_text(table)
    if args.plot is not None:
        plot.plot(report, args.plot)


def _complain(report: Report) -> int:
    """Warnings and sample error bodies on stderr; the exit status."""
    for line in warnings(report.steps):
        print(line, file=sys.stderr)
    samples = report.error_samples()
    for status, text in samples.items():
        print(f"sample answer with status {status}: {text.strip()}", file=sys.stderr)
    if report.ok == 0:
        first = next(iter(samples.items()), None)
        said = f"; the first answer: {first[0]} {first[1].strip()}" if first else ""
        print(f"batchserve bench: every request failed{said}", file=sys.stderr)
        return FAILED
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``batchserve bench``: sweep a v2 infer endpoint and report what it measured."""
    args = _parser().parse_args(argv)
    problem = _check(args)
    if problem is not None:
        print(f"batchserve bench: {problem}", file=sys.stderr)
        return USAGE
    try:
        report = _sweep(args, args.url.rstrip("/"))
    except (probe.Unreachable, requests.RequestError) as exc:
        print(f"batchserve bench: {exc}", file=sys.stderr)
        return FAILED
    except ValueError as exc:
        print(f"batchserve bench: {exc}", file=sys.stderr)
        return USAGE
    _write(args, report)
    return _complain(report)


if __name__ == "__main__":
    sys.exit(main())
