"""`batchserve plan` against the live server: predicted and measured passing rates.

    python -m benchmarks.plan_check [--processes 1,2] [--rates 1600,...] [--rounds 2]

Starts one server per number of `mlp` runner processes (the bundled configuration with
`workers` set), all at once and idle but for the one under load, each writing its batch log.
For each round and rate it loads each server in turn with `batchserve bench` at that rate, so
every setting meets the machine in the same state, and records whether the step passed (p99
of OK answers within the limit and fewer than 1% non-OK), the server's and the client's CPU per
request, and the cores the rest of the machine took meanwhile. Then it runs the plan on the
batch log of the first server, with the client's measured CPU per request, and prints, per
number of processes, the highest rate that passed in every round beside the plan's.
Run it under the bench lock on a shared machine; about 4 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from batchserve.api.bench.cpu import TICK, cpu_between, server_cpu

ROOT = Path(__file__).resolve().parent.parent
BATCHSERVE = str(Path(sys.executable).parent / "batchserve")
MAX_FAILED = 0.01
LIMIT_MS = 100.0  # the bundled mlp's max_latency_ms


class Server(NamedTuple):
    process: subprocess.Popen[bytes]
    url: str
    logs: Path


@dataclass(frozen=True)
class Step:
    processes: int
    round: int
    rate: float
    passed: bool
    p99_ms: float | None
    failed: float
    server_ms: float
    client_ms: float
    others_cores: float


def busy_s() -> float:
    """CPU seconds the whole machine has spent busy so far."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


def config_with(processes: int, folder: Path) -> Path:
    document = yaml.safe_load((ROOT / "configuration.yml").read_text())
    document["runners"]["mlp"]["workers"] = processes
    path = folder / f"configuration-{processes}.yml"
    path.write_text(yaml.safe_dump(document))
    return path


@contextlib.contextmanager
def servers(counts: Sequence[int], port: int, folder: Path) -> Iterator[dict[int, Server]]:
    """One server per count of processes, each with its batch log folder; stopped at exit."""
    started: dict[int, Server] = {}
    try:
        for index, count in enumerate(counts):
            logs = folder / f"log-{count}"
            logs.mkdir()
            env = dict(os.environ, BATCHSERVE_BATCH_LOG=str(logs))
            process = subprocess.Popen(
                [BATCHSERVE, "serve", "--config", str(config_with(count, folder)),
                 "--port", str(port + index)], env=env, cwd=ROOT, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started[count] = Server(process, f"http://127.0.0.1:{port + index}", logs)
        for server in started.values():
            wait_ready(server.url)
            bench(server.url, 200.0, 3.0)  # warm-up, not reported
        yield started
    finally:
        for server in started.values():
            server.process.send_signal(signal.SIGINT)
        for server in started.values():
            server.process.wait(60)


def wait_ready(url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2):
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not get ready in {timeout:g} s")


def bench(url: str, rate: float, seconds: float) -> dict[str, Any]:
    run = subprocess.run(
        [BATCHSERVE, "bench", "--url", url, "--model", "mlp", "--rate", f"{rate:g}",
         "--seconds", f"{seconds:g}", "--json", "-"], capture_output=True, text=True, check=True)
    step: dict[str, Any] = json.loads(run.stdout)["steps"][0]
    return step


def measure(server: Server, count: int, rnd: int, rate: float, seconds: float) -> Step:
    cpu, machine, began = server_cpu(server.process.pid), busy_s(), time.monotonic()
    load = bench(server.url, rate, seconds)
    spent = cpu_between(cpu, server_cpu(server.process.pid)).seconds
    wall = time.monotonic() - began
    sent, ok, p99 = load["sent"], load["ok"], load["ok_p99_ms"]
    failed = (sent - ok) / sent if sent else 1.0
    passed = p99 is not None and p99 <= LIMIT_MS and failed < MAX_FAILED
    others = (busy_s() - machine - spent - load["loadgen_cpu_s"]) / wall
    return Step(count, rnd, rate, passed, p99, failed, spent / sent * 1000.0,
                load["loadgen_cpu_s"] / sent * 1000.0, others)


def passing(steps: Sequence[Step], count: int) -> float:
    """The highest rate at which every round passed (0 if none)."""
    mine = [s for s in steps if s.processes == count]
    rates = {s.rate for s in mine}
    return max((r for r in rates if all(s.passed for s in mine if s.rate == r)), default=0.0)


def table(steps: Sequence[Step], counts: Sequence[int], plans: dict[int, float]) -> str:
    """Per number of processes: each round's highest passing rate (with the cores other work
    took in that round), the highest that passed in every round, the plan's and the ratio."""
    rounds = sorted({s.round for s in steps})
    head = " | ".join(f"round {r + 1}: passed up to (other work)" for r in rounds)
    lines = [f"| processes | {head} | every round | plan | plan / every round |",
             "|---:|" + "---:|" * (len(rounds) + 3)]
    for count in counts:
        cells = []
        for r in rounds:
            mine = [s for s in steps if s.processes == count and s.round == r]
            best = max((s.rate for s in mine if s.passed), default=0.0)
            others = statistics.median(s.others_cores for s in mine)
            cells.append(f"{best:.0f} ({others:.2f} cores)")
        live = passing(steps, count)
        ratio = f"{plans[count] / live:.2f}" if live else "-"
        lines.append(f"| {count} | {' | '.join(cells)} | {live:.0f} | {plans[count]:.0f} | "
                     f"{ratio} |")
    return "\n".join(lines)


def plan_command(logs: Path, counts: Sequence[int], client_ms: float) -> list[str]:
    return [BATCHSERVE, "plan", "--batch-log", str(logs), "--config",
            str(ROOT / "configuration.yml"), "--runner", "mlp", "--target", "1000",
            "--processes", ",".join(map(str, counts)), "--client-ms", f"{client_ms:.3f}"]


def predicted(command: list[str]) -> tuple[dict[int, float], float]:
    """Each setting's passing rate by the plan, and how long the plan took."""
    report = json.loads(subprocess.run([*command, "--json"], capture_output=True, text=True,
                                       check=True).stdout)
    rates = {s["processes"]: s["passing_rps"] for s in report["settings"]}
    return rates, report["seconds"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_check")
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--rates", default="1600,2000,2400,2800,3200,3600")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=3391)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.processes.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    steps: list[Step] = []
    with tempfile.TemporaryDirectory(prefix="plan-check-") as tmp:
        with servers(counts, args.port, Path(tmp)) as running:
            for rnd in range(args.rounds):
                for rate in rates:
                    for count in counts:
                        steps.append(measure(running[count], count, rnd, rate, args.seconds))
                        print(json.dumps(asdict(steps[-1])), file=sys.stderr, flush=True)
        client_ms = statistics.median(s.client_ms for s in steps)
        command = plan_command(running[counts[0]].logs, counts, client_ms)
        plans, took = predicted(command)
    print(" ".join(["batchserve", *command[1:]]).replace(tmp, "$LOGS"))
    print(f"client CPU {client_ms:.3f} ms/req; other work took "
          f"{statistics.median(s.others_cores for s in steps):.2f} cores (median over steps, "
          f"the bench command's own start included); the plan took {took:.1f} s\n")
    print(table(steps, counts, plans))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
