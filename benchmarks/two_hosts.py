"""Two runner hosts against one: goodput under the same overload.

    sudo python -m benchmarks.two_hosts [--rate 600] [--seconds 20] [--choice random]

Each runner host is a network namespace of its own (`tests/netns.py`), as is the API tier
(`batchserve serve --api-only`, two workers) and this load generator, which sits in the API's
namespace. The API finds the runners by name through its hosts file: first one host, then
both. The same open-loop Poisson rate (`api/bench/loadgen.py`) is offered to each, above what two
hosts can serve, and goodput is the answers that came back 200 within the runner's limit
(100 ms), per second.

What this measures, and what it does not: the hosts share this machine's CPU, so a model
that computes would be bounded by those cores however many hosts there are. The model here
(`paced_pid_echo` of `tests/fixture_models.py`) spends 20 ms per batch of up to 4 rows
waiting, not computing: each host serves about 200 rows a second whatever the CPU does, as a
runner bound by its own accelerator or I/O would. So the ratio shows that the API tier
spreads load across hosts it finds by name, and that its own CPU cost is not the limit at
these rates; it says nothing of how a CPU-bound model scales on real machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
from prometheus_client.parser import text_string_to_metric_families

from batchserve.api.bench.load_result import LoadResult
from batchserve.api.bench.loadgen import loop_factory, run_load
from batchserve.api.bench.server import batchserve_command
from tests.netns import Host, Network, unavailable

ROOT = Path(__file__).resolve().parent.parent
NAME = "runners.bs"
RUNNER_PORT, STATUS_PORT, API_PORT = 7000, 7001, 8000
LIMIT_MS = 100.0
HOST_CAPACITY_RPS = 200.0  # 4 rows per 20 ms batch
CONFIG = """
timeouts: {{resolve_s: 1}}
api: {{host: {api}, workers: 2}}
transport: {{token_file: token}}
runners:
  paced:
    model: fixture_models:paced_pid_echo
    {addresses}
    choice: {choice}
    batching: {{max_batch_size: 4, max_latency_ms: {limit:g}}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: echo, datatype: FP32, shape: [-1, 4]}},
              {{name: pid, datatype: INT64, shape: [-1, 1]}}]
"""
TOKEN = "two-hosts-benchmark-token-0123456789"
BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                 "data": [1, 2, 3, 4]}]})


@dataclass(frozen=True)
class Phase:
    """One run: how many runner hosts, what the client saw, and the rows each host ran."""

    hosts: int
    load: LoadResult
    served: dict[str, float]

    def line(self) -> str:
        load = self.load
        counts = ", ".join(f"{status} {n}" for status, n in sorted(load.status_counts.items()))
        shares = ", ".join(f"{name} {rows:.0f}" for name, rows in self.served.items())
        return (f"{self.hosts} host(s): offered {load.offered_rate:.0f} req/s, goodput "
                f"{load.goodput:.1f} req/s (200 within {LIMIT_MS:g} ms), OK p99 "
                f"{_ms(load.ok_p99_ms)}; answers {counts}; rows run per host: {shares}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


class Bench:
    """The namespaces, the processes in them, and how to reach them from the API's host."""

    def __init__(self, net: Network, folder: Path) -> None:
        self.net = net
        self.folder = folder
        self.api = net.host("api", 2)
        self.runners = {name: net.host(name, number) for name, number in (("r1", 11), ("r2", 12))}
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, host: Host, args: Sequence[str], log: str) -> subprocess.Popen[bytes]:
        with (self.folder / log).open("wb") as out:
            process = subprocess.Popen([*host.prefix, *batchserve_command(), *args],
                                       stdout=out, stderr=subprocess.STDOUT, cwd=self.folder,
                                       stdin=subprocess.DEVNULL)
        self.processes.append(process)
        return process

    def get(self, url: str) -> str:
        with self.net.inside(self.api), urllib.request.urlopen(url, timeout=2) as answer:
            return str(answer.read().decode())

    def wait(self, url: str, process: subprocess.Popen[bytes], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with status {process.returncode}; see "
                                   f"{self.folder}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                self.get(url)
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} not ready after {timeout:g} s; see {self.folder}")

    def start(self, timeout: float) -> None:
        for name, host in self.runners.items():
            process = self.spawn(host, [
                "runner", "--config", "runner.yml", "--runner", "paced",
                "--listen", f"tcp:{host.ip}:{RUNNER_PORT}", "--metrics-port", str(STATUS_PORT),
            ], f"{name}.log")
            self.wait(f"http://{host.ip}:{STATUS_PORT}/health/ready", process, name, timeout)
        self.publish(1)
        front = self.spawn(self.api, ["serve", "--config", "front.yml", "--api-only",
                                      "--port", str(API_PORT)], "api.log")
        self.wait(f"{self.url}/v2/health/ready", front, "the API tier", timeout)

    @property
    def url(self) -> str:
        return f"http://{self.api.ip}:{API_PORT}"

    def publish(self, hosts: int) -> None:
        self.net.hosts_file(self.api, {NAME: list(self.runners.values())[:hosts]})

    def connected(self) -> float:
        return _metric(self.get(f"{self.url}/metrics"), "batchserve_runner_processes_connected")

    def served(self) -> dict[str, float]:
        return {name: _metric(self.get(f"http://{host.ip}:{STATUS_PORT}/metrics"),
                              "batchserve_adaptive_batch_size_sum")
                for name, host in self.runners.items()}

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _metric(text: str, name: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)


def measure(bench: Bench, hosts: int, args: argparse.Namespace) -> Phase:
    """Point the name at `hosts` runner hosts, wait until both API workers connect to them,
    warm up, then offer the overload."""
    bench.publish(hosts)
    deadline = time.monotonic() + 30
    while bench.connected() != 2 * hosts:  # two API workers, one connection each per host
        if time.monotonic() > deadline:
            raise RuntimeError(f"the API tier did not connect to {hosts} host(s) in 30 s")
        time.sleep(0.2)
    target = f"{bench.url}/v2/models/paced/infer"
    headers = {"Content-Type": "application/json"}
    with bench.net.inside(bench.api), asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(run_load(target, BODY, headers, rate=100, seconds=2, seed=args.seed + 1))
        before = bench.served()
        load = runner.run(run_load(target, BODY, headers, rate=args.rate, seconds=args.seconds,
                                   seed=args.seed, slo_ms=LIMIT_MS))
    after = bench.served()
    return Phase(hosts, load, {name: after[name] - before[name] for name in after})


def prepare(folder: Path, api: Host, choice: str) -> None:
    shutil.copy(ROOT / "tests" / "fixture_models.py", folder / "fixture_models.py")
    (folder / "token").write_text(TOKEN + "\n")
    common = {"api": api.ip, "choice": choice, "limit": LIMIT_MS}
    (folder / "runner.yml").write_text(CONFIG.format(addresses="", **common))
    (folder / "front.yml").write_text(CONFIG.format(
        addresses=f"addresses: [dns+tcp:{NAME}:{RUNNER_PORT}]", **common))


@contextlib.contextmanager
def bench_in(folder: Path, choice: str, timeout: float) -> Iterator[Bench]:
    with Network("bench") as net:
        bench = Bench(net, folder)
        prepare(folder, bench.api, choice)
        try:
            bench.start(timeout)
            yield bench
        finally:
            bench.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=3 * HOST_CAPACITY_RPS,
                   help="offered req/s, the same for one host and two (default 600)")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--choice", choices=("random", "least_loaded_of_two"), default="random")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"two_hosts: cannot make network namespaces: {why}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="batchserve-two-hosts-"))
    with bench_in(folder, args.choice, args.ready_timeout) as bench:
        phases = [measure(bench, hosts, args) for hosts in (1, 2)]
    one, two = phases
    print(f"two runner hosts against one, {args.rate:g} req/s offered for {args.seconds:g} s "
          f"(each host about {HOST_CAPACITY_RPS:g} req/s; choice {args.choice}; logs in "
          f"{folder})")
    for phase in phases:
        print("  " + phase.line())
    ratio = two.load.goodput / one.load.goodput if one.load.goodput else float("nan")
    print(f"  goodput ratio, two hosts over one: {ratio:.2f}")
    if args.json:
        args.json.write_bytes(orjson.dumps(
            {"rate": args.rate, "seconds": args.seconds, "choice": args.choice,
             "ratio": ratio, "phases": [{"hosts": phase.hosts, "served": phase.served,
                                         "load": phase.load.as_dict()} for phase in phases]}))
    lost = [phase for phase in phases if phase.load.answered != phase.load.sent]
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
