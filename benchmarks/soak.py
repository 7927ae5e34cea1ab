"""Soak: the real server at a steady open-loop rate for a long time, memory watched.

    python -m benchmarks.soak [--rate 1900] [--seconds 600] [--window 10] [--json FILE]

Starts the server on the bundled configuration, warms it up, then sends Poisson traffic in
windows of ``--window`` seconds until ``--seconds`` have passed. It reports every server
process's resident memory after the warm-up and at the end (growth must stay under 5%), the
p99 of each window, and whether every request sent got exactly one answer. The default rate
is about 80% of what this 2-core machine serves with its load generator beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from batchserve.api.bench.bench import infer_body
from batchserve.api.bench.cpu import process_tree
from batchserve.api.bench.loadgen import loop_factory, run_load
from batchserve.api.bench.server import serve

ROOT = Path(__file__).resolve().parent.parent
CONNECTIONS = 256  # the most the load generator opens at a time
SURGE_S = 3.0


def rss_kib(pid: int) -> int | None:
    """Resident set size of one process, KiB; None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def server_rss(root: int) -> dict[int, int]:
    return {s.pid: kib for s in process_tree(root) if (kib := rss_kib(s.pid)) is not None}


@dataclass
class Soak:
    rate: float
    seconds: float
    sent: int = 0
    answered: int = 0
    ok: int = 0
    window_p99_ms: list[float] = field(default_factory=list)
    rss_start_kib: dict[int, int] = field(default_factory=dict)
    rss_end_kib: dict[int, int] = field(default_factory=dict)

    def growth(self) -> dict[int, float]:
        """Per process alive at both ends: RSS growth as a fraction of the start."""
        return {pid: self.rss_end_kib[pid] / kib - 1.0 for pid, kib in self.rss_start_kib.items()
                if pid in self.rss_end_kib}

    def report(self) -> str:
        growth = self.growth()
        worst = max(growth.values(), default=0.0)
        p99 = sorted(self.window_p99_ms)
        lines = [
            f"soak: {self.rate:g} req/s for {self.seconds:g} s: sent {self.sent}, answered "
            f"{self.answered}, ok {self.ok}; every request answered once: "
            f"{'yes' if self.sent == self.answered else 'NO'}",
            f"p99 per window: median {p99[len(p99) // 2]:.1f} ms, worst {p99[-1]:.1f} ms"
            if p99 else "p99 per window: none",
            f"RSS growth, worst process: {worst * 100:.2f}% (under 5%: "
            f"{'yes' if worst < 0.05 else 'NO'})",
        ]
        lines += [f"  pid {pid}: {self.rss_start_kib[pid] / 1024:.1f} -> "
                  f"{self.rss_end_kib[pid] / 1024:.1f} MiB ({g * 100:+.2f}%)"
                  for pid, g in sorted(growth.items())]
        return "\n".join(lines)


def soak(url: str, root: int, rate: float, seconds: float, window: float,
         runner: asyncio.Runner, warmup_s: float = 15.0) -> Soak:
    """Warm up first, to the high-water mark of an API worker's allocator: it grows by a few
    MB, once, with the most connections and requests it has held at a time, which a hiccup
    of the machine (a late client, a busy core) can raise at any moment of a run. So the
    warm-up holds every connection the client may open busy at once (`SURGE_S` at three
    times the rate), then runs `warmup_s` at the rate: from there on, growth is a leak."""
    body, headers = infer_body(1, 256, binary=False)
    target = f"{url}/v2/models/mlp/infer"
    runner.run(run_load(target, body, headers, rate=3 * rate, seconds=SURGE_S,
                        max_connections=CONNECTIONS, warm_connections=CONNECTIONS))
    runner.run(run_load(target, body, headers, rate=rate, seconds=warmup_s,
                        max_connections=CONNECTIONS))
    result = Soak(rate, seconds, rss_start_kib=server_rss(root))
    elapsed = 0.0
    while elapsed < seconds:
        span = min(window, seconds - elapsed)
        load = runner.run(run_load(target, body, headers, rate=rate, seconds=span,
                                   max_connections=CONNECTIONS))
        result.sent += load.sent
        result.answered += load.answered
        result.ok += load.ok
        if load.p99_ms is not None:
            result.window_p99_ms.append(load.p99_ms)
        elapsed += span
    result.rss_end_kib = server_rss(root)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configuration.yml")
    p.add_argument("--api-workers", type=int, default=2)
    p.add_argument("--rate", type=float, default=1900.0)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.port = 0
    log = Path(tempfile.mkdtemp(prefix="batchserve-soak-")) / "server.log"
    with serve(args, log, cwd=ROOT) as (url, root), \
            asyncio.Runner(loop_factory=loop_factory()) as runner:
        result = soak(url, root, args.rate, args.seconds, args.window, runner)
    print(result.report())
    if args.json:
        args.json.write_bytes(orjson.dumps(asdict(result), option=orjson.OPT_NON_STR_KEYS))
    healthy = result.sent == result.answered and max(result.growth().values(), default=0) < 0.05
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
