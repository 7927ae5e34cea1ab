"""Where a request's CPU goes in batchserve: per step, per process kind, at a given rate.

Starts the real server on the bundled ``configuration.yml`` (its API workers, the ``mlp``
runner), drives it with the open-loop client at each rate and, during the same window, samples
every server process with ``py-spy record --subprocesses``. Each process's CPU time (from
``/proc``) is split among the steps in proportion to its non-idle samples, then divided by
the requests sent: microseconds of CPU per request, per step. A second window at the same
rate without py-spy gives the undisturbed total.

    flock /tmp/batchserve-bench.lock python -m benchmarks.request_path --rates 100,1600

A stack is charged to the step of its innermost frame that matches :data:`STEPS`; native code
(orjson, httptools, uvloop, torch's kernels) shows as the Python frame that called it.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import orjson

from batchserve.api.bench.bench import infer_body
from batchserve.api.bench.cpu import cmdline, cpu_by_pid, server_cpu
from batchserve.api.bench.loadgen import loop_factory, run_load
from batchserve.api.bench.server import serve

ROOT = Path(__file__).resolve().parent.parent

STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model forward (torch)", ("torch/",)),
    ("runner: model call glue", ("runner/models.py",)),
    ("runner: batching loop (dispatcher, policy)",
     ("runner/dispatcher.py", "runner/batching.py", "runner/policy/adaptive.py", "runner/policy",
      "runner/policy/latency_model.py", "runner/sim/batch_times.py", "runner/core/timeouts.py")),
    # A thread whose innermost frame is `Thread.run` runs native code: in an API worker,
    # grpc.aio's poller, which waits on gRPC's completion queue and wakes the event loop.
    ("gRPC: grpc.aio's poller thread (C-core completion queue)", ("Thread.run (threading.py",)),
    ("runner: thread-pool handoff to the model thread", ("concurrent/futures", "threading.py")),
    ("unix-socket writes, API <-> runner (writelines)", ("Outbox._flush",)),
    ("wire encode/decode (API <-> runner)", ("runner/core/wire.py",)),
    ("runner: connection", ("runner/server.py",)),
    ("gRPC door: decode, encode (protobuf)", ("api/grpc/codec.py", "google/protobuf")),
    ("gRPC door: calls (grpcio, api/grpc)", ("grpc/aio", "_cygrpc", "grpc/_cython",
                                             "api/grpc/")),
    ("v2 JSON decode + validate", ("decode_infer", "_decode_", "from_json", "_convert",
                                   "_check_layout", "_split (", "_load (")),
    ("v2 reply encode", ("encode_infer", "output_json", "output_data", "output_array")),
    ("API: dispatch to runner (pool, link)", ("api/dispatch.py",)),
    ("API: the exchange (admission, answer, response)",
     ("api/service.py", "api/http/connection.py", "api/backlog.py", "api/overload.py",
      "api/reserve.py", "api/admission.py", "api/errors.py")),
    ("metrics", ("prometheus_client", "runner/metrics.py")),
    ("API: app, routing (Starlette)", ("api/http/app.py", "starlette/")),
    ("HTTP parse + ASGI (uvicorn, httptools)", ("uvicorn/", "httptools")),
    ("event loop, sockets (uvloop, asyncio)", ("asyncio/", "uvloop", "run_forever",
                                                "Runner.run", "selectors")),
)
OTHER = "other"


def step_of(frames: Sequence[str]) -> str:
    """The step of the innermost frame (stacks are outermost first) that matches one."""
    for frame in reversed(frames):
        for step, marks in STEPS:
            if any(mark in frame for mark in marks):
                return step
    return OTHER


def kind_of(command: str) -> str:
    if "batchserve.api.worker" in command or "api.worker" in command:
        return "API workers"
    if "batchserve.runner" in command or " runner " in command:
        return "runner"
    return "supervisor"


def samples(collapsed: Path) -> dict[int, Counter[str]]:
    """Per pid, non-idle samples by step, from ``py-spy --format raw`` with ``--subprocesses``."""
    out: dict[int, Counter[str]] = {}
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        owners = [f for f in frames if f.startswith("process ")]
        if not owners:
            continue
        pid = int(owners[-1].split()[1].rstrip(":").split(":")[0])
        out.setdefault(pid, Counter())[step_of(frames)] += int(count)
    return out


def spy(root: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    tool = Path(sys.executable).with_name("py-spy")
    cmd = [str(tool) if tool.exists() else "py-spy", "record", "--pid", str(root),
           "--subprocesses", "--nonblocking", "--rate", "200", "--format", "raw",
           "--duration", str(int(seconds)), "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def window(runner: asyncio.Runner, root: int, url: str, rate: float, seconds: float,
           profile: Path | None) -> tuple[int, dict[int, float]]:
    """Requests sent and CPU seconds per server pid over one run (py-spy attached if asked)."""
    body, headers = infer_body(1, 256, binary=False)
    before = server_cpu(root)
    proc = spy(root, seconds + 1, profile) if profile else None
    load = runner.run(run_load(url, body, headers, rate, seconds, seed=7))
    after = server_cpu(root)
    if proc is not None:
        _, err = proc.communicate(timeout=seconds + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"py-spy failed: {err.decode(errors='replace').strip()}")
    return load.sent, cpu_by_pid(before, after)


def per_step(sent: int, cpu: dict[int, float], counts: dict[int, Counter[str]]
             ) -> dict[str, dict[str, float]]:
    """µs of CPU per request, by step and by process kind."""
    table: dict[str, dict[str, float]] = {}
    for pid, seconds in cpu.items():
        kind = kind_of(cmdline(pid))
        got = counts.get(pid, Counter())
        total = sum(got.values())
        shares = {s: n / total for s, n in got.items()} if total else {OTHER: 1.0}
        for step, share in shares.items():
            row = table.setdefault(step, {})
            row[kind] = row.get(kind, 0.0) + share * seconds * 1e6 / sent
    return table


def markdown(rates: Sequence[float], tables: dict[float, dict[str, dict[str, float]]],
             plain: dict[float, float]) -> str:
    kinds = ("API workers", "runner", "supervisor")
    order = [s for s, _ in STEPS] + [OTHER]
    head = "| step | " + " | ".join(f"{k} at {r:g}" for r in rates for k in kinds[:2])
    lines = [head + " |", "|---|" + "---:|" * (2 * len(rates))]
    for step in order:
        cells = [tables[r].get(step, {}).get(k, 0.0) for r in rates for k in kinds[:2]]
        if any(c >= 0.5 for c in cells):
            lines.append(f"| {step} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    totals = [sum(v.get(k, 0.0) for v in tables[r].values()) for r in rates for k in kinds]
    lines.append("| **total, µs/req (profiled)** | " + " | ".join(
        f"**{sum(v.get(k, 0.0) for v in tables[r].values()):.0f}**"
        for r in rates for k in kinds[:2]) + " |")
    sup = ", ".join(f"{r:g}: {t:.0f}" for r, t in zip(rates, totals[2::3], strict=True))
    undisturbed = ", ".join(f"{r:g} req/s: {plain[r] * 1e3:.0f} µs" for r in rates)
    return "\n".join(lines) + (f"\n\nSupervisor, µs/req: {sup}. Whole server without py-spy "
                               f"attached, per request: {undisturbed}.")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="100,1600")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=Path("/tmp/batchserve-request-path"))
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    serve_args = argparse.Namespace(port=0, config=ROOT / "configuration.yml", api_workers=None,
                                    ready_timeout=120.0)
    tables, plain, windows = {}, {}, {}
    with serve(serve_args, args.out / "server.log", cwd=ROOT) as (base, root), \
            asyncio.Runner(loop_factory=loop_factory()) as runner:
        url = f"{base}/v2/models/mlp/infer"
        window(runner, root, url, 200.0, 3.0, None)  # warm-up
        for rate in rates:
            sent, cpu = window(runner, root, url, rate, args.seconds, None)
            plain[rate] = sum(cpu.values()) * 1e3 / sent
            profile = args.out / f"stacks-{rate:g}.txt"
            sent, cpu = window(runner, root, url, rate, args.seconds, profile)
            tables[rate] = per_step(sent, cpu, samples(profile))
            windows[rate] = {"sent": sent, "cpu_s": cpu, "kinds": {p: kind_of(cmdline(p))
                                                                  for p in cpu}}
    print(markdown(rates, tables, plain))
    saved = {"per_step_us": tables, "plain_ms": plain, "profiled": windows}
    (args.out / "steps.json").write_bytes(orjson.dumps(saved, option=orjson.OPT_NON_STR_KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
