"""Batch time against batch size for the example models (`examples/models.yml`), offline.

Times `resnet` (images) and `encoder` (sequences of `--tokens` ids), or the bundled `mlp`
(rows of 256 floats), at batch sizes 1 to `--largest` on `--threads` torch threads: wall
time, the calling thread's CPU time (what the latency model fits) and the whole process's
(every torch thread's), then fits the latency model's line (`intercept + slope * n`, least
squares over every size) and prints the fit against what was observed at each size:

    python -m benchmarks.model_curves --threads 2 --largest 32
    python -m benchmarks.model_curves --models mlp --threads 1 --largest 64 --idle-ms 15

Back to back, a batch runs on caches the one before left warm; a server's model thread
sleeps between batches (`--idle-ms` before each timed one), and wakes to caches other work
has taken. Timed back to back the least of the repeats is kept, the closest to what the
batch costs alone; after an idle gap the median, as a server meets it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from batchserve.runner.bundled import mlp
from batchserve.runner.encoder import Encoder
from batchserve.runner.policy.latency_model import weighted_line
from batchserve.runner.vision import ResNet


def images(rows: int) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(rows)
    return (torch.from_numpy(rng.random((rows, 3, 224, 224), dtype=np.float32)),)


def sequences(tokens: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def make(rows: int) -> tuple[torch.Tensor, ...]:
        rng = np.random.default_rng(rows)
        flat = torch.from_numpy(rng.integers(0, 1 << 20, rows * tokens))
        return flat, torch.arange(1, rows + 1) * tokens
    return make


def mlp_rows(count: int) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(count)
    return (torch.from_numpy(rng.random((count, 256), dtype=np.float32)),)


def time_batch(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], repeats: int,
               idle_s: float = 0.0) -> tuple[float, float, float]:
    """Wall, calling-thread CPU and process CPU seconds of `repeats` calls, each after
    `idle_s` asleep: the least of them with no sleep, else the median (see the module doc)."""
    walls, cpus, processes = [], [], []
    with torch.inference_mode():
        model(*inputs)
        for _ in range(repeats):
            if idle_s:
                time.sleep(idle_s)
            wall, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
            model(*inputs)
            cpus.append(time.thread_time() - cpu)
            processes.append(time.process_time() - process)
            walls.append(time.perf_counter() - wall)
    pick = np.median if idle_s else min
    return float(pick(walls)), float(pick(cpus)), float(pick(processes))


def curve(name: str, model: torch.nn.Module, make: Callable[[int], tuple[torch.Tensor, ...]],
          sizes: list[int], repeats: int, idle_s: float = 0.0) -> None:
    timed = [time_batch(model, make(n), repeats, idle_s) for n in sizes]
    rows = np.array(sizes, float)
    for label, column in (("wall", 0), ("thread cpu", 1), ("process cpu", 2)):
        ms = np.array([t[column] * 1000 for t in timed])
        intercept, slope = weighted_line(rows, ms, np.ones_like(rows))
        print(f"\n{name} ({label}): fit {intercept:.2f} ms + {slope:.2f} ms x n")
        print("   n  observed ms    fit ms   fit/obs   obs ms/row")
        for n, observed in zip(sizes, ms, strict=True):
            fit = intercept + slope * n
            print(f"{n:4d} {observed:12.2f} {fit:9.2f} {fit / observed:9.2f} "
                  f"{observed / n:11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--largest", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="resnet,encoder",
                        help="any of resnet, encoder and mlp, comma-separated")
    parser.add_argument("--idle-ms", type=float, default=0.0,
                        help="sleep this long before each timed batch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n <= args.largest]
    chosen, idle_s = args.models.split(","), args.idle_ms / 1000
    if "resnet" in chosen:
        curve("resnet", ResNet(), images, sizes, args.repeats, idle_s)
    if "encoder" in chosen:
        curve(f"encoder, {args.tokens} tokens a sequence", Encoder(), sequences(args.tokens),
              sizes, args.repeats, idle_s)
    if "mlp" in chosen:
        curve("mlp", mlp(), mlp_rows, sizes, args.repeats, idle_s)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
