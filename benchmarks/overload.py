"""Overload for half a minute, then ordinary traffic: what the server keeps and how fast it heals.

    python -m benchmarks.overload [--times 3] [--seconds 30] [--json FILE]

Serves a model that takes 5 ms a batch whatever its size, with a cap of 4 rows and a 50 ms
limit: about 800 rows a second. It offers `--times` that rate of single rows for `--seconds`
and reports the answers by status, the p99 of the accepted ones against the limit, how fast
refusals come back, every server process's resident memory before and after, and then how
long after the load stops the server answers normally again: requests every 10 ms from the
moment the last overload answer came back, until ten 200s in a row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import orjson

from batchserve.api.bench.load_result import LoadResult
from batchserve.api.bench.loadgen import loop_factory, run_load
from batchserve.api.bench.scrape import bucket_delta, fetch
from batchserve.api.bench.server import serve
from benchmarks.soak import server_rss

ROOT = Path(__file__).resolve().parent.parent
OK_HISTOGRAM = "batchserve_request_duration_seconds"
CAPACITY_RPS = 800.0  # 4 rows per 5 ms batch
LIMIT_MS = 50.0
CONFIG = f"""
api: {{workers: 2}}
runners:
  busy:
    model: fixture_models:busy_echo
    batching: {{max_batch_size: 4, max_latency_ms: {LIMIT_MS:g}}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 4]}}]
"""
BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                 "data": [1, 2, 3, 4]}]})


@dataclass
class Overload:
    load: LoadResult
    rss_before_kib: dict[int, int]
    rss_after_kib: dict[int, int]
    server_ok_within: float | None  # share answered within the limit, timed by the server
    recovery_s: float | None  # from the end of the overload to the first of ten 200s in a row

    def report(self) -> str:
        load = self.load
        healed = "none within 10 s" if self.recovery_s is None else f"{self.recovery_s:.2f} s"
        lines = [
            f"overload: {load.offered_rate:.0f} req/s offered ({load.send_rate:.0f} sent) for "
            f"{load.seconds:g} s against about {CAPACITY_RPS:.0f} req/s of capacity",
            f"  sent {load.sent}, answered {load.answered}, by status {load.status_counts}",
            f"  accepted p99 {_ms(load.ok_p99_ms)} at the client (limit {LIMIT_MS:g} ms); "
            f"within the limit: {_share(self.server_ok_within)} timed by the server, "
            f"{_share(load.good / load.ok if load.ok else None)} by the client; goodput "
            f"{load.goodput:.0f} req/s; refusals p50 {_ms(load.refused_p50_ms)}, "
            f"p99 {_ms(load.refused_p99_ms)}; client send lag p99 {_ms(load.timer_lag_p99_ms)}",
            f"  recovery: {healed} from the last overload answer to ten 200s in a row",
        ]
        for pid, before in sorted(self.rss_before_kib.items()):
            after = self.rss_after_kib.get(pid)
            if after is not None:
                lines.append(f"  pid {pid}: {before / 1024:.1f} -> {after / 1024:.1f} MiB "
                             f"({(after / before - 1) * 100:+.2f}%)")
        return "\n".join(lines)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.2f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def recovery(url: str, timeout_s: float = 10.0) -> float | None:
    """Seconds until the first of ten 200s in a row, one request every 10 ms."""
    started = time.monotonic()
    streak_start, streak = 0.0, 0
    with httpx.Client(timeout=2) as client:
        while time.monotonic() - started < timeout_s:
            sent = time.monotonic()
            ok = client.post(url, content=BODY).status_code == 200
            if ok and streak == 0:
                streak_start = sent
            streak = streak + 1 if ok else 0
            if streak == 10:
                return streak_start - started
            time.sleep(max(0.0, 0.01 - (time.monotonic() - sent)))
    return None


@contextlib.contextmanager
def fixture_server(args: argparse.Namespace, config: str, api_workers: int,
                   prefix: str) -> Iterator[tuple[str, int]]:
    """`serve` on `config`, whose models are `tests/fixture_models.py`'s: both are put in a
    fresh folder (`prefix`...), with the server's log."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    shutil.copy(ROOT / "tests" / "fixture_models.py", folder / "fixture_models.py")
    (folder / "configuration.yml").write_text(config)
    args.config, args.port, args.api_workers = folder / "configuration.yml", 0, api_workers
    with serve(args, folder / "server.log", cwd=ROOT) as served:
        yield served


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--times", type=float, default=3.0, help="offered load over capacity")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with fixture_server(args, CONFIG, 2, "batchserve-overload-") as (url, root), \
            asyncio.Runner(loop_factory=loop_factory()) as runner:
        target = f"{url}/v2/models/busy/infer"
        headers = {"Content-Type": "application/json"}
        runner.run(run_load(target, BODY, headers, rate=200, seconds=2))  # warm up
        before, scraped = server_rss(root), fetch(url).buckets(OK_HISTOGRAM, code="200")
        load = runner.run(run_load(target, BODY, headers, rate=args.times * CAPACITY_RPS,
                                   seconds=args.seconds, slo_ms=LIMIT_MS))
        ok = bucket_delta(scraped, fetch(url).buckets(OK_HISTOGRAM, code="200"))
        within = ok[LIMIT_MS / 1000] / ok[math.inf] if ok.get(math.inf) else None
        result = Overload(load, before, server_rss(root), within, recovery(target))
    print(result.report())
    if args.json:
        args.json.write_bytes(orjson.dumps(asdict(result), option=orjson.OPT_NON_STR_KEYS))
    return 0 if load.answered == load.sent and result.recovery_s is not None else 1


if __name__ == "__main__":
    sys.exit(main())
