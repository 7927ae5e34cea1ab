"""The example models side by side: batchserve, mosec and Triton, the same weights and the
same requests (binary images where the server takes them), each peer at every batching
setting of a grid, so that it is held to its best fixed setting and not to a default.

A skeleton of the measuring run: each server is started fresh for each setting, answers one
request before the load, and is stopped with everything it started; each rate is open-loop
load from `batchserve bench`'s generator, with the server's whole process tree's CPU read
around it. It prints one line per server, setting and rate: goodput within the model's limit,
p50 and p99 of the answers, CPU per request. The peers run from their own venvs
(``.peers/<name>/``, see ``benchmarks/peers``)::

    python -m benchmarks.peers.examples_sweep --model resnet --rates 2,4,8 --seconds 20 \\
        --batch-sizes 4,8,16 --waits-ms 5,20,50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import orjson

from batchserve.api.bench.cpu import cpu_between, server_cpu
from batchserve.api.bench.loadgen import run_load
from batchserve.api.bench.server import batchserve_command, free_port
from benchmarks.peers.launch import stop
from benchmarks.peers.peer import ROOT, SHIM, VENVS, make_shim

LIMITS_MS = {"resnet": 300.0, "encoder": 100.0}
"""Each model's limit in examples/models.yml: goodput counts answers within it."""
TOKENS = 64
"""The length of every sequence sent to the encoder (Triton batches equal lengths only)."""
SERVERS = ("batchserve", "mosec", "triton")


@dataclass(frozen=True)
class Setting:
    """One server with one batching setting (batchserve's is adaptive: none to give)."""

    server: str
    max_batch_size: int = 0
    max_wait_ms: int = 0

    @property
    def label(self) -> str:
        if self.server == "batchserve":
            return "adaptive"
        return f"max_batch_size={self.max_batch_size}, max_wait_ms={self.max_wait_ms}"


@dataclass(frozen=True)
class Row:
    server: str
    setting: str
    rate: float
    goodput: float
    p50_ms: float | None
    p99_ms: float | None
    cpu_ms_per_request: float


def command(setting: Setting, model: str, port: int, threads: int, venvs: Path
            ) -> tuple[list[str], str]:
    """The command line that starts the server, and the URL of one inference."""
    if setting.server == "batchserve":
        config = ROOT / "examples" / "models.yml"
        return ([*batchserve_command(), "serve", "--config", str(config), "--port", str(port),
                 "--grpc-port", "0"], f"http://127.0.0.1:{port}/v2/models/{model}/infer")
    python = str(venvs / setting.server / "bin" / "python")
    argv = [python, "-m", f"benchmarks.peers.{setting.server}_examples", "--model", model,
            "--max-batch-size", str(setting.max_batch_size),
            "--max-wait-ms", str(setting.max_wait_ms), "--threads", str(threads),
            "--port", str(port)]
    if setting.server == "mosec":
        return ([*argv, "--address", "127.0.0.1", "--log-level", "warning"],
                f"http://127.0.0.1:{port}/inference")
    return argv, f"http://127.0.0.1:{port}/v2/models/{model}/infer"


def request(server: str, model: str) -> tuple[bytes, dict[str, str]]:
    """One request's body and headers, as each server takes it."""
    rng = np.random.default_rng(0)
    if model == "resnet":
        image = rng.random((1, 3, 224, 224), dtype=np.float32)
        if server == "mosec":  # its own binary way: the raw bytes of one image
            return image.tobytes(), {"Content-Type": "application/octet-stream"}
        header = orjson.dumps({"inputs": [{
            "name": "images", "datatype": "FP32", "shape": list(image.shape),
            "parameters": {"binary_data_size": image.nbytes}}]})
        return header + image.tobytes(), {"Content-Type": "application/octet-stream",
                                          "Inference-Header-Content-Length": str(len(header))}
    tokens = rng.integers(0, 8192, TOKENS).tolist()
    if server == "mosec":
        body = {"tokens": tokens}
    else:  # batchserve takes one sequence a request; Triton a batch of one row
        shape = [TOKENS] if server == "batchserve" else [1, TOKENS]
        body = {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": shape,
                            "data": tokens}]}
    return orjson.dumps(body), {"Content-Type": "application/json"}


def settings(servers: list[str], sizes: list[int], waits: list[int]) -> Iterator[Setting]:
    for server in servers:
        if server == "batchserve":
            yield Setting(server)
        else:
            yield from (Setting(server, size, wait) for size in sizes for wait in waits)


def answered(url: str, body: bytes, headers: dict[str, str], proc: subprocess.Popen[bytes],
             timeout_s: float) -> None:
    """Send one request until the server answers 200, it dies, or time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with status {proc.returncode}")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30):
                return
        time.sleep(0.5)
    raise RuntimeError(f"no answer from {url} within {timeout_s:g} s")


def measure(setting: Setting, args: argparse.Namespace, log: Path) -> list[Row]:
    port = free_port()
    argv, url = command(setting, args.model, port, args.threads, args.venvs)
    body, headers = request(setting.server, args.model)
    peer = setting.server != "batchserve"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=_environment() if peer else None)
    rows = []
    try:
        answered(url, body, headers, proc, args.ready_timeout)
        for rate in args.rates:
            before = server_cpu(proc.pid)
            load = asyncio.run(run_load(url, body, headers, rate, args.seconds,
                                        slo_ms=LIMITS_MS[args.model]))
            cpu = cpu_between(before, server_cpu(proc.pid))
            rows.append(Row(setting.server, setting.label, rate, load.goodput, load.ok_p50_ms,
                            load.ok_p99_ms, cpu.seconds * 1000 / max(load.sent, 1)))
    finally:
        stop(proc)
    return rows


def _environment() -> dict[str, str]:
    make_shim()
    return {**os.environ, "PYTHONPATH": os.pathsep.join((str(SHIM), str(ROOT)))}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _numbers(text: str) -> list[int]:
    return [int(value) for value in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(LIMITS_MS), required=True)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--rates", type=lambda t: [float(r) for r in t.split(",")],
                        default=[2.0, 4.0, 8.0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batch-sizes", type=_numbers, default=[4, 8, 16])
    parser.add_argument("--waits-ms", type=_numbers, default=[5, 20, 50])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of a peer")
    parser.add_argument("--venvs", type=Path, default=VENVS)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--log", type=Path, default=Path("examples_sweep.log"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows: list[Row] = []
    for setting in settings(args.servers.split(","), args.batch_sizes, args.waits_ms):
        for row in measure(setting, args, args.log):
            rows.append(row)
            print(f"{row.server:10} {row.setting:36} {row.rate:7g}/s goodput "
                  f"{row.goodput:7.2f}/s p50 {_ms(row.p50_ms)} p99 {_ms(row.p99_ms)} cpu "
                  f"{row.cpu_ms_per_request:.1f} ms/req", flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))


if __name__ == "__main__":
    main()
