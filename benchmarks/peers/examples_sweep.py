"""The example models side by side: batchserve, mosec and Triton, the same weights and the
same requests (binary images where the server takes them), each peer held to its best fixed
batching setting and not to a default.

Three phases, each a fresh start of every server it runs, which answers one request (checked
against the model computed here) and a short warm-up before the load; each rate is open-loop
Poisson load from `batchserve bench`'s generator, with the server's whole process tree's CPU
read around it:

- ``sweep``: each peer at every setting of a small grid, at two rates near its limit;
- ``grid``: batchserve (adaptive) and each peer at its best setting, at every rate;
- ``overload``: each server at twice its own knee (twice the lowest rate if none held).

Every run is merged into a results file (``--results``), so the phases, models and servers
can be measured one invocation at a time (each under the bench lock, a few minutes long) and
the table rendered from all of them (``--doc``; ``--phases ''`` renders without measuring).
The peers run from their own venvs (``.peers/<name>/``, see ``benchmarks/peers``)::

    flock /tmp/batchserve-bench.lock python -m benchmarks.peers.examples_sweep \\
        --model resnet --phases sweep
    flock /tmp/batchserve-bench.lock python -m benchmarks.peers.examples_sweep \\
        --model resnet --phases grid,overload --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

import numpy as np
import orjson

from batchserve.api.bench.cpu import cpu_between, server_cpu
from batchserve.api.bench.loadgen import run_load
from batchserve.api.bench.server import batchserve_command, free_port
from benchmarks.live_table import replace_block
from benchmarks.peers.examples_table import (
    Run,
    Setting,
    best_setting,
    knee,
    merge,
    model_block,
    select,
)
from benchmarks.peers.launch import stop
from benchmarks.peers.peer import ROOT, SHIM, VENVS, make_shim

LIMITS_MS = {"resnet": 300.0, "encoder": 100.0}
"""Each model's limit in examples/models.yml: goodput counts answers within it."""
TOKENS = 64
"""The length of every sequence sent to the encoder (Triton batches equal lengths only)."""
SERVERS = ("batchserve", "mosec", "triton")
BLOCK = ("<!-- examples: start -->", "<!-- examples: end -->")
RESULTS = ROOT / "docs" / "examples.json"


@dataclass(frozen=True)
class Plan:
    """What one model is measured at: the sweep's settings and rates, and the grid's rates."""

    batch_sizes: tuple[int, ...]
    waits_ms: tuple[int, ...]
    sweep_rates: tuple[float, ...]
    rates: tuple[float, ...]


PLANS = {
    # 30-40 ms an image on both cores at the best batch, 60-80 ms of CPU: some 20-30 images/s.
    "resnet": Plan((4, 16), (10, 50), (10.0, 20.0), (3.0, 6.0, 10.0, 14.0, 18.0, 22.0)),
    # 5-10 ms a 64-token sequence on both cores, 9-19 ms of CPU: some 100-200 sequences/s.
    "encoder": Plan((8, 32), (5, 20), (60.0, 120.0), (10.0, 40.0, 70.0, 100.0, 130.0, 160.0)),
}


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


def inputs(model: str) -> np.ndarray:
    """The one input every request carries: an image, or a sequence of token ids."""
    rng = np.random.default_rng(0)
    if model == "resnet":
        return rng.random((1, 3, 224, 224), dtype=np.float32)
    return rng.integers(0, 8192, TOKENS)


def request(server: str, model: str) -> tuple[bytes, dict[str, str]]:
    """One request's body and headers, as each server takes it."""
    if model == "resnet":
        image = inputs(model)
        if server == "mosec":  # its own binary way: the raw bytes of one image
            return image.tobytes(), {"Content-Type": "application/octet-stream"}
        header = orjson.dumps({"inputs": [{
            "name": "images", "datatype": "FP32", "shape": list(image.shape),
            "parameters": {"binary_data_size": image.nbytes}}]})
        return header + image.tobytes(), {"Content-Type": "application/octet-stream",
                                          "Inference-Header-Content-Length": str(len(header))}
    tokens = inputs(model).tolist()
    if server == "mosec":
        body: dict[str, object] = {"tokens": tokens}
    else:  # batchserve takes one sequence a request; Triton a batch of one row
        shape = [TOKENS] if server == "batchserve" else [1, TOKENS]
        body = {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": shape,
                            "data": tokens}]}
    return orjson.dumps(body), {"Content-Type": "application/json"}


def answer(server: str, model: str, reply: bytes) -> np.ndarray:
    """The model's output in one server's reply, flat."""
    if server == "mosec":
        if model == "resnet":
            return np.frombuffer(reply, np.float32)
        return np.asarray(orjson.loads(reply)["embedding"], np.float32)
    return np.asarray(orjson.loads(reply)["outputs"][0]["data"], np.float32)


@cache
def reference(model: str) -> np.ndarray:
    """The model's output for the request, computed here from the same weights."""
    import torch

    from batchserve.runner.encoder import Encoder
    from batchserve.runner.vision import ResNet

    with torch.inference_mode():
        if model == "resnet":
            out = ResNet()(torch.from_numpy(inputs(model)))
        else:
            tokens = torch.from_numpy(inputs(model))
            out = Encoder()(tokens, torch.tensor([TOKENS]))
    return np.asarray(out.numpy(), np.float32).reshape(-1)


def check(setting: Setting, model: str, reply: bytes) -> None:
    got, want = answer(setting.server, model, reply), reference(model)
    worst = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("inf")
    if worst > 1e-3 * float(np.max(np.abs(want))) + 1e-5:
        raise RuntimeError(f"{setting.server} answered {got.shape} values, worst difference "
                           f"{worst:.3g} from the model's own")


def answered(url: str, body: bytes, headers: dict[str, str], proc: subprocess.Popen[bytes],
             timeout_s: float) -> bytes:
    """Send one request until the server answers 200, it dies, or time is up; the reply."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with status {proc.returncode}")
        with contextlib.suppress(urllib.error.URLError, OSError):
            request_ = urllib.request.Request(url, body, headers)
            with urllib.request.urlopen(request_, timeout=30) as response:
                return bytes(response.read())
        time.sleep(0.5)
    raise RuntimeError(f"no answer from {url} within {timeout_s:g} s")


@contextlib.contextmanager
def running(setting: Setting, args: argparse.Namespace, model: str
            ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The server started fresh, checked on one request; stopped with all it started after."""
    port = free_port()
    argv, url = command(setting, model, port, args.threads, args.venvs)
    peer = setting.server != "batchserve"
    with args.log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=_environment() if peer else None)
    try:
        body, headers = request(setting.server, model)
        check(setting, model, answered(url, body, headers, proc, args.ready_timeout))
        yield proc, url
    finally:
        stop(proc)


def measure(setting: Setting, args: argparse.Namespace, model: str, phase: str,
            rates: Sequence[float]) -> list[Run]:
    """``setting`` on a fresh server at each of ``rates``, after a warm-up not kept."""
    body, headers = request(setting.server, model)
    limit = LIMITS_MS[model]
    runs = []
    with running(setting, args, model) as (proc, url):
        asyncio.run(run_load(url, body, headers, PLANS[model].rates[0], args.warmup_seconds,
                             slo_ms=limit))
        for rate in rates:
            answered(url, body, headers, proc, args.ready_timeout)  # the last rate's queue gone
            before = server_cpu(proc.pid)
            load = asyncio.run(run_load(url, body, headers, rate, args.seconds, slo_ms=limit))
            cpu = cpu_between(before, server_cpu(proc.pid))
            refused = load.status_counts.get("503", 0)
            run = Run(model, phase, setting.server, setting.max_batch_size,
                      setting.max_wait_ms, rate, args.seconds, load.sent, load.good, load.ok,
                      refused, load.goodput, load.ok_p50_ms, load.ok_p99_ms,
                      cpu.seconds * 1000 / max(load.sent, 1),
                      datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
            print(_line(run), flush=True)
            runs.append(run)
    return runs


def phase_settings(phase: str, model: str, servers: Sequence[str], runs: Sequence[Run]
                   ) -> Iterator[Setting]:
    """The settings a phase runs: every one of the plan's for the sweep, else the best."""
    plan = PLANS[model]
    for server in servers:
        if server == "batchserve":
            if phase != "sweep":
                yield Setting(server)
        elif phase == "sweep":
            yield from (Setting(server, size, wait)
                        for size in plan.batch_sizes for wait in plan.waits_ms)
        else:
            sweep = select(runs, model, "sweep", server)
            if not sweep:
                raise SystemExit(f"no sweep of {server} on {model} in the results: run "
                                 f"--phases sweep first")
            yield best_setting(sweep)


def phase_rates(phase: str, model: str, setting: Setting, runs: Sequence[Run]
                ) -> list[float]:
    if phase == "sweep":
        return list(PLANS[model].sweep_rates)
    if phase == "grid":
        return list(PLANS[model].rates)
    rate = knee([r for r in select(runs, model, "grid", setting.server)
                 if r.setting == setting])
    if rate is None:
        rate = PLANS[model].rates[0]  # nothing held: twice the lowest rate is overload
    return [2 * rate]


def load_runs(path: Path) -> list[Run]:
    if not path.exists():
        return []
    return [Run.from_dict(item) for item in json.loads(path.read_text())["runs"]]


def save_runs(path: Path, runs: Sequence[Run]) -> None:
    path.write_text(json.dumps({"runs": [asdict(r) for r in runs]}, indent=1) + "\n")


def render(runs: Sequence[Run]) -> str:
    """The block of the page: every model measured, in the order of :data:`LIMITS_MS`."""
    models = [model for model in LIMITS_MS if any(r.model == model for r in runs)]
    return "\n\n".join(model_block(runs, model, LIMITS_MS[model], SERVERS) for model in models)


def _environment() -> dict[str, str]:
    make_shim()
    return {**os.environ, "PYTHONPATH": os.pathsep.join((str(SHIM), str(ROOT)))}


def _line(run: Run) -> str:
    p99 = "-" if run.p99_ms is None else f"{run.p99_ms:.1f} ms"
    return (f"{run.model:8} {run.phase:8} {run.server:10} {run.setting.label:34} "
            f"{run.rate:6g}/s goodput {run.goodput:6.1f}/s ({100 * run.good_share:5.1f}%) "
            f"503 {run.refused:5} p99 {p99} cpu {run.cpu_ms_per_request:.1f} ms/req")


def _names(text: str, allowed: Sequence[str]) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(allowed)}")
    return names


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", type=lambda t: _names(t, tuple(LIMITS_MS)),
                        default=list(LIMITS_MS), help="resnet, encoder or both")
    parser.add_argument("--servers", type=lambda t: _names(t, SERVERS), default=list(SERVERS))
    parser.add_argument("--phases", type=lambda t: _names(t, ("sweep", "grid", "overload")),
                        default=["sweep", "grid", "overload"])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of a peer")
    parser.add_argument("--venvs", type=Path, default=VENVS)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--log", type=Path, help="the servers' output (appended)",
                        default=Path(tempfile.gettempdir()) / "examples_sweep.log")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, help="replace the examples block of this page")
    args = parser.parse_args(argv)
    runs = load_runs(args.results)
    for model in args.model:
        for phase in args.phases:
            for setting in list(phase_settings(phase, model, args.servers, runs)):
                rates = phase_rates(phase, model, setting, runs)
                runs = merge(runs, measure(setting, args, model, phase, rates))
                save_runs(args.results, runs)
    if args.doc:
        replace_block(args.doc, render(runs), *BLOCK)
    else:
        print(render(runs))


if __name__ == "__main__":
    main()
