"""Measure the request path: start the real server, drive it open-loop, count its CPU.

For each rate this prints p50/p99 latency (from each request's scheduled send time, see
``api/bench/loadgen.py``), the error share, and the CPU time per request of the server (every
process under the supervisor) and of the load generator itself, which runs on the same 2
cores and so takes its share from the server.

Server CPU is utime+stime from ``/proc/<pid>/stat`` summed over the supervisor's process
tree, sampled before and after each rate. Only processes alive at both samples count (keyed
by pid and start time, so a reused pid is not mistaken for its predecessor); a process that
exits mid-rate takes its CPU with it, and the table says how many did
(``batchserve.api.bench.cpu``; the server is started by ``batchserve.api.bench.server``).

    python benchmarks/load.py --rates 100,1000,1600 --seconds 20 [--binary] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from batchserve.api.bench.bench import infer_body
from batchserve.api.bench.cpu import CpuDelta, cmdline, cpu_between, process_tree, tree_cpu
from batchserve.api.bench.load_result import LoadResult
from batchserve.api.bench.loadgen import loop_factory, run_load
from batchserve.api.bench.server import serve

ROOT = Path(__file__).resolve().parent.parent


# -- one rate


@dataclass(frozen=True)
class Row:
    load: LoadResult
    server: CpuDelta

    @property
    def server_cpu_ms_per_req(self) -> float:
        return self.server.seconds * 1e3 / self.load.sent if self.load.sent else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            **self.load.as_dict(),
            "server_cpu_s": self.server.seconds,
            "server_cpu_ms_per_req": self.server_cpu_ms_per_req,
            "server_processes": self.server.processes,
            "server_processes_exited": self.server.exited,
            "server_processes_started": self.server.started,
        }


def measure(
    runner: asyncio.Runner, root: int, url: str, args: argparse.Namespace, rate: float
) -> Row:
    body, headers = infer_body(args.rows, 256, binary=args.binary)
    before = tree_cpu(root)
    load = runner.run(run_load(url, body, headers, rate, args.seconds, args.seed))
    after = tree_cpu(root)
    return Row(load, cpu_between(before, after))


# -- profiling


def profile(root: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """py-spy over the whole server tree (API workers and runners alike), not pausing it.

    ``--subprocesses`` keeps this independent of how the supervisor starts its children;
    the collapsed-stack output names each process at the root of its stacks.
    """
    cmd = ["py-spy", "record", "--pid", str(root), "--subprocesses", "--nonblocking"]
    cmd += ["--duration", str(max(1, int(seconds))), "--rate", "100", "--format", "raw"]
    cmd += ["--output", str(out)]
    spy = Path(sys.executable).with_name("py-spy")
    if spy.exists():
        cmd[0] = str(spy)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def top_frames(collapsed: Path, limit: int = 12) -> dict[str, list[tuple[str, float]]]:
    """Per process, the frames with the most self time (share of that process's samples).

    With ``--subprocesses`` every stack starts with its ancestry (``process PID:"cmd"``
    frames, supervisor first), so the last such frame names the process sampled.
    """
    per_process: dict[str, dict[str, int]] = {}
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        owners = [f for f in frames if f.startswith("process ")]
        process = owners[-1][:110] if owners else "process ?"
        counts = per_process.setdefault(process, {})
        counts[frames[-1]] = counts.get(frames[-1], 0) + int(count)
    report = {}
    for process, counts in per_process.items():
        total = sum(counts.values())
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
        report[f"{process} ({total} samples)"] = [(f, n / total) for f, n in ranked]
    return report


def profiled_rate(
    runner: asyncio.Runner, root: int, url: str, args: argparse.Namespace
) -> tuple[Row, Path]:
    """One more run at ``--profile-rate`` with py-spy attached; its numbers are perturbed."""
    args.profile.mkdir(parents=True, exist_ok=True)
    out = args.profile / f"server-{int(args.profile_rate)}rps.txt"
    spy = profile(root, args.seconds, out)
    try:
        row = measure(runner, root, url, args, args.profile_rate)
    finally:
        _, err = spy.communicate(timeout=args.seconds + 30)
    if spy.returncode != 0:
        raise RuntimeError(f"py-spy failed: {err.decode(errors='replace').strip()}")
    return row, out


# -- report


def markdown(rows: Sequence[Row]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"

    lines = [
        "| rate | achieved | p50 ms | p99 ms | errors % | server CPU ms/req | loadgen CPU ms/req |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        load = row.load
        lines.append(
            f"| {load.target_rate:g} | {load.achieved_rate:.0f} | {ms(load.p50_ms)} "
            f"| {ms(load.p99_ms)} | {load.errors * 100:.2f} | {row.server_cpu_ms_per_req:.3f} "
            f"| {load.loadgen_cpu_ms_per_req:.3f} |"
        )
    return "\n".join(lines)


def notes(rows: Sequence[Row]) -> str:
    exited = sum(r.server.exited for r in rows)
    lags = ", ".join(f"{r.load.timer_lag_p99_ms or 0:.2f}" for r in rows)
    errors = "; ".join(
        f"{r.load.target_rate:g}: {r.load.error_fraction}" for r in rows if r.load.error_fraction
    )
    lines = [f"load generator timer lag p99 (ms, included in latency): {lags}"]
    if errors:
        lines.append(f"errors by status: {errors}")
    if exited:
        lines.append(f"{exited} server process(es) exited mid-rate; their CPU is not counted")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configuration.yml")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--api-workers", type=int, default=2)
    p.add_argument("--rates", default="100,1000,1600", help="comma-separated req/s")
    p.add_argument("--seconds", type=float, default=20.0, help="duration of each rate")
    p.add_argument("--warmup-rate", type=float, default=200.0)
    p.add_argument("--warmup-seconds", type=float, default=5.0)
    p.add_argument("--binary", action="store_true", help="v2 binary tensors instead of JSON")
    p.add_argument("--rows", type=int, default=1, help="rows per request")
    p.add_argument("--model", default="mlp", help="runner to load (FP32 input x of 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--profile", type=Path, help="folder for a py-spy profile of the server")
    p.add_argument("--profile-rate", type=float, default=1000.0)
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, object]:
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    log = Path(tempfile.gettempdir()) / f"batchserve-bench-{os.getpid()}.log"
    report: dict[str, object] = {"server_log": str(log)}
    with serve(args, log, cwd=ROOT) as (base, root), \
            asyncio.Runner(loop_factory=loop_factory()) as runner:
        url = f"{base}/v2/models/{args.model}/infer"
        report["processes"] = {s.pid: cmdline(s.pid) for s in process_tree(root)}
        body, headers = infer_body(args.rows, 256, binary=args.binary)
        warm = run_load(url, body, headers, args.warmup_rate, args.warmup_seconds, args.seed + 1)
        runner.run(warm)
        rows = [measure(runner, root, url, args, rate) for rate in rates]
        report["rows"] = rows
        if args.profile:
            report["profiled"] = profiled_rate(runner, root, url, args)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except RuntimeError as exc:
        print(f"load.py: {exc}", file=sys.stderr)
        return 1
    rows: list[Row] = report["rows"]  # type: ignore[assignment]
    profiled: tuple[Row, Path] | None = report.get("profiled")  # type: ignore[assignment]
    if args.json:
        out = {k: v for k, v in report.items() if k not in ("rows", "profiled")}
        out["rows"] = [r.as_dict() for r in rows]
        if profiled:
            out["profiled"] = {**profiled[0].as_dict(), "profile": str(profiled[1])}
            out["top_frames"] = top_frames(profiled[1])
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())
        return 0
    print(markdown(rows))
    print()
    print(notes(rows))
    if profiled:
        print_profile(*profiled)
    return 0


def print_profile(row: Row, path: Path) -> None:
    print(f"\nprofiled run (py-spy attached, numbers perturbed):\n{markdown([row])}")
    print(f"collapsed stacks: {path} (open in https://www.speedscope.app)")
    for process, frames in top_frames(path).items():
        print(f"\n{process}")
        for frame, share in frames:
            print(f"  {share:6.1%}  {frame}")


if __name__ == "__main__":
    sys.exit(main())
