"""Ragged against padding: one text model served both ways on one mix of lengths.

    python -m benchmarks.ragged [--requests 2000] [--concurrency 64] [--seed 0] [--json F]

Starts `batchserve serve` on `benchmarks/ragged_text/configuration.yml`: the bundled text
model twice with the same weights, `ragged` (every request's token ids concatenated, with
end offsets) and `pad` (ids padded to the longest request of the batch, with lengths), and
likewise a model with a layer on every token, whose cost follows its tokens (`encoded_*`).
The same requests, in the same order, go to each in turn from `--concurrency` closed-loop
clients (batchserve's asyncio client, binary tensors), after a warm-up. Reported for each:
rows (requests) per second, elements computed (the token positions the model ran over,
padding included: a padded batch of r rows whose longest has n tokens computes r * n), the
elements the requests held, the mean batch and latency; then the ratios. Each answer also
carries its share of its batch's elements and of one batch (`ragged_text/counted_text.py`),
so the counts come from the model itself. Run it from the repository root, under the bench
lock on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import orjson

from batchserve.api.bench.server import serve
from batchserve.api.client import AsyncModelClient
from batchserve.runner.text_model import VOCAB

ROOT = Path(__file__).resolve().parent.parent
CONFIG = Path(__file__).resolve().parent / "ragged_text" / "configuration.yml"
PAIRS = (("ragged", "pad"), ("encoded_ragged", "encoded_pad"))
"""Runners of one model each: ragged first, then padded."""
MIX = ((0.70, 4, 32), (0.25, 32, 128), (0.05, 256, 512))
"""(share, shortest, longest) of the lengths: mostly short texts and a few long ones."""


def lengths(count: int, seed: int) -> np.ndarray:
    """Token counts drawn from `MIX`, uniform within each band."""
    rng = np.random.default_rng(seed)
    bands = rng.choice(len(MIX), size=count, p=[share for share, _, _ in MIX])
    return np.array([rng.integers(MIX[b][1], MIX[b][2] + 1) for b in bands])


def texts(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(0, VOCAB, int(n)) for n in lengths(count, seed)]


@dataclass(frozen=True)
class Run:
    layout: str
    requests: int
    seconds: float
    rows_per_s: float
    elements_computed: float
    elements_sent: int
    batches: float
    mean_batch_rows: float
    p50_ms: float
    p99_ms: float

    def row(self) -> str:
        return (f"| {self.layout} | {self.requests} | {self.rows_per_s:.0f} | "
                f"{self.elements_computed:,.0f} | {self.elements_sent:,} | "
                f"{self.elements_computed / self.elements_sent:.2f} | {self.batches:.0f} | "
                f"{self.mean_batch_rows:.1f} | {self.p50_ms:.1f} | {self.p99_ms:.1f} |")


async def drive(url: str, layout: str, requests: list[np.ndarray], concurrency: int) -> Run:
    """Send every request from `concurrency` closed-loop clients; what the answers say."""
    latencies: list[float] = []
    elements = batches = 0.0
    queue = iter(requests)
    async with AsyncModelClient(url, layout, timeout_s=60) as client:
        await client.metadata()

        async def worker() -> None:
            nonlocal elements, batches
            for tokens in queue:
                sent = time.perf_counter()
                answer = await client.infer_batch(tokens=tokens)
                latencies.append(time.perf_counter() - sent)
                elements += float(answer["elements"].sum())
                batches += float(answer["batches"].sum())

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    p50, p99 = np.percentile(np.array(latencies) * 1000, [50, 99])
    return Run(layout, len(requests), seconds, len(requests) / seconds, elements,
               sum(len(tokens) for tokens in requests), batches, len(requests) / batches,
               float(p50), float(p99))


def markdown(runs: Sequence[Run], concurrency: int) -> str:
    lines = [
        f"{runs[0].requests} requests a runner, {concurrency} closed-loop clients; lengths: "
        + ", ".join(f"{share:.0%} {low}-{high}" for share, low, high in MIX) + " tokens",
        "",
        "| runner | requests | rows/s | elements computed | elements sent | computed / sent "
        "| batches | mean batch | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(run.row() for run in runs),
        "",
    ]
    for ragged, pad in zip(runs[::2], runs[1::2], strict=True):
        lines.append(
            f"- {ragged.layout} / {pad.layout}: {ragged.rows_per_s / pad.rows_per_s:.2f}x the "
            f"rows per second; {pad.layout} computes "
            f"{pad.elements_computed / ragged.elements_computed:.2f}x the elements"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-workers", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    requests, warmup = texts(args.requests, args.seed), texts(args.warmup, args.seed + 7)
    options = argparse.Namespace(config=CONFIG, port=0, api_workers=args.api_workers,
                                 ready_timeout=300.0)
    runs = []
    with tempfile.TemporaryDirectory() as folder, serve(
        options, Path(folder) / "server.log", cwd=ROOT
    ) as (url, _pid):
        for pair in PAIRS:
            for runner in pair:
                asyncio.run(drive(url, runner, warmup, args.concurrency))
                runs.append(asyncio.run(drive(url, runner, requests, args.concurrency)))
    print(markdown(runs, args.concurrency))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps([asdict(run) for run in runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
