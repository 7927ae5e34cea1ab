"""``python -m benchmarks.peers``: batchserve and the servers users pick instead, one client.

    python -m benchmarks.peers --install          # each peer's own venv under .peers/ (once)
    flock /tmp/batchserve-bench.lock python -m benchmarks.peers --rounds 2
    python -m benchmarks.peers --servers mosec,batchserve --busy 2 --out DIR --doc ''
    python -m benchmarks.peers --servers batchserve,mosec,triton --block "peers triton" --out DIR
    flock /tmp/batchserve-bench.lock python -m benchmarks.peers --client shared \
        --servers batchserve,mosec,triton --rates 100,1600,2400,3200,4800,6400

With ``--client shared`` the load comes from the shared clients beside the checkout
(``../shared/tools``: ``loadgen.py`` up to 2,400 req/s, ``fastload.py`` above), each server is
also measured idle, and overload runs every server at one rate, twice the highest rate any
of them passed and at least 6,400 req/s; the tables go to ``docs/peers-shared.json`` and the
``peers shared`` markers of ``docs/benchmarks.md``.

Writes ``docs/peers.json`` (every run), ``docs/peers.png`` and the tables between the markers
of ``docs/benchmarks.md``. What is measured and how: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import orjson

from batchserve.api.bench.load_result import LoadResult
from batchserve.api.bench.loadgen import loop_factory
from benchmarks.busy import beside, busy
from benchmarks.peers import model_limit, report
from benchmarks.peers.peer import FEATURES, ROOT, VENVS, Peer, make_shim
from benchmarks.peers.servers import PEERS
from benchmarks.peers.sweep import Idle, Run, Settings, rounds

START = "<!-- peers: start -->"
END = "<!-- peers: end -->"
SHARED_START = "<!-- peers shared: start -->"
SHARED_END = "<!-- peers shared: end -->"
SHOWN = ("torch", "numpy", "uvloop", "uvicorn", "starlette", "fastapi")
OVERLOAD_FLOOR = 6400.0
"""The shared-client overload rate is never below this, whatever the servers passed."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default=",".join(PEERS), help="comma-separated, of: "
                   + ", ".join(PEERS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rates", default="100,400,800,1600,2400,3200", help="req/s, Poisson")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each rate")
    p.add_argument("--warmup-rate", type=float, default=200.0)
    p.add_argument("--warmup-seconds", type=float, default=3.0)
    p.add_argument("--drain", type=float, default=5.0, help="s to wait for answers after sends")
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="folder of peers.json/png")
    p.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"),
                   help="markdown file whose peers markers receive the tables ('' for none)")
    p.add_argument("--block", default="",
                   help="the name of the --doc markers to write between (<!-- NAME: start -->); "
                        "default 'peers', or 'peers shared' with --client shared")
    p.add_argument("--client", choices=("ours", "shared"), default="ours",
                   help="batchserve's own load generator, or the shared clients")
    p.add_argument("--idle", type=float, default=20.0,
                   help="s of no traffic measured per server and round (0: none)")
    p.add_argument("--busy", type=int, default=0,
                   help="CPU-bound processes to run beside the servers (not the model limit)")
    p.add_argument("--install", action="store_true", help="create missing venvs, then exit")
    p.add_argument("--from-json", type=Path, help="render a saved peers.json again, no runs")
    return p.parse_args(argv)


def install(peers: Sequence[Peer]) -> None:
    """Each peer in its own venv, with torch pinned on the same command line as the peer, and
    numpy, which the bundled model's module imports (torch no longer pulls it in)."""
    for peer in peers:
        venv = VENVS / peer.name
        if not peer.own_venv or (venv / "bin" / "python").exists():
            continue
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", *peer.packages, "torch==2.13.0", "numpy"]
        subprocess.run(pip, check=True)


def versions(peer: Peer) -> dict[str, str]:
    """What ``pip list`` says in the peer's venv, for the packages that matter here."""
    out = subprocess.run([peer.python(), "-m", "pip", "list", "--format", "json"],
                         capture_output=True, text=True, check=False).stdout
    names = {re.split(r"[\[<>=]", p)[0].lower() for p in peer.packages} | set(SHOWN)
    names.add("batchserve" if not peer.own_venv else "")
    listed = json.loads(out) if out.strip() else []
    return {p["name"]: p["version"] for p in listed if p["name"].lower() in names}


def machine() -> dict[str, object]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                        time.gmtime())}


def measure(args: argparse.Namespace, peers: Sequence[Peer]) -> dict[str, object]:
    grid = [float(r) for r in args.rates.split(",") if r.strip()]
    row = np.random.default_rng(0).standard_normal(FEATURES, dtype=np.float32).tolist()
    expected = model_limit.reference(row)
    print("model limit (offline, one torch thread) ...", flush=True)
    limit = model_limit.samples_per_second()
    logs = Path(f"/tmp/batchserve-peers-{os.getpid()}")
    logs.mkdir(parents=True, exist_ok=True)
    settings = Settings(args.seconds, args.warmup_rate, args.warmup_seconds, args.drain, logs,
                        shared=args.client == "shared", idle_s=args.idle)
    failures: dict[str, str] = {}
    idles: list[Idle] = []
    began = time.monotonic()
    with busy(args.busy), asyncio.Runner(loop_factory=loop_factory()) as runner:
        runs = rounds(runner, peers, row, expected, lambda p: grid, args.rounds, settings,
                      failures, idles)
        extra = overload_plan(runs, peers, grid, settings.shared)
        print(f"overload rates off the grid: {extra}", flush=True)
        runs += rounds(runner, peers, row, expected, lambda p: extra[p.name], args.rounds,
                       settings, failures)
    return {"machine": machine(), "client": args.client, "idles": idles,
            "grid": grid, "rounds": args.rounds, "seconds": args.seconds,
            "warmup": [args.warmup_rate, args.warmup_seconds], "logs": str(logs),
            "minutes": (time.monotonic() - began) / 60, "model_limit": limit, "busy": args.busy,
            "servers": {p.name: {"batching": p.batching, "versions": versions(p)} for p in peers},
            "failures": failures, "runs": runs}


def overload_plan(runs: Sequence[Run], peers: Sequence[Peer], grid: Sequence[float],
                  shared: bool) -> dict[str, list[float]]:
    """Rates off the grid per server: 1.5x and 2x its own best rate; with the shared clients,
    one rate for all, twice the best any passed and at least :data:`OVERLOAD_FLOOR`."""
    if shared:
        best = max((b for p in peers if (b := report.best_rate(runs, p.name, grid))),
                   default=0.0)
        rate = max(OVERLOAD_FLOOR, 2 * best)
        return {p.name: [rate] if rate not in grid else [] for p in peers}
    return {p.name: [r for r in report.overload_rates(report.best_rate(runs, p.name, grid))
                     if r not in grid] for p in peers}


def overload_rate(result: dict[str, object]) -> float:
    """The shared clients' overload rate: the highest any run offered."""
    return max(r.rate for r in result["runs"])  # type: ignore[attr-defined]


def load(path: Path) -> dict[str, object]:
    """A saved ``peers.json`` back into the shape :func:`measure` returns."""
    saved = orjson.loads(path.read_bytes())
    saved.pop("summaries", None)
    saved["model_limit"] = {int(k): v for k, v in saved["model_limit"].items()}
    saved["runs"] = [Run(r["server"], r["round"], r["rate"], LoadResult(**r["load"]),
                         r["cpu_s"], r["processes"], r.get("wait_s", 0.0), r.get("recovery_s"))
                      for r in saved["runs"]]
    saved["idles"] = [Idle(**i) for i in saved.get("idles", [])]
    return saved  # type: ignore[no-any-return]


def markdown(result: dict[str, object], summaries: Sequence[report.Summary]) -> str:
    limit: dict[int, float] = result["model_limit"]  # type: ignore[assignment]
    best = max(limit, key=lambda size: limit[size])
    runs: list[Run] = result["runs"]  # type: ignore[assignment]
    servers: dict[str, dict[str, object]] = result["servers"]  # type: ignore[assignment]
    failures: dict[str, str] = result["failures"]  # type: ignore[assignment]
    shared = result.get("client") == "shared"
    clients = ("the shared clients (loadgen.py up to 2,400 req/s, fastload.py above); "
               if shared else "")
    parts = [
        f"Measured {result['machine']['date']} on {result['machine']['cpu']}, "  # type: ignore[index]
        f"{result['machine']['cores']} cores{beside(int(result.get('busy', 0)))}; "  # type: ignore[call-overload]
        f"{clients}{result['rounds']} rounds, "  # type: ignore[index]
        f"{result['seconds']:g} s per rate, {result['minutes']:.0f} minutes in all.",
    ]
    grid: list[float] = result["grid"]  # type: ignore[assignment]
    idles: list[Idle] = result.get("idles", [])  # type: ignore[assignment]
    parts.append(report.cost_table(runs, idles, grid, int(result["rounds"])))  # type: ignore[call-overload]
    if shared:
        parts.append(report.overload_table(runs, overload_rate(result)))
    parts += [
        report.table(summaries, limit[best]),
        f"Model limit (offline, one torch thread): **{limit[best]:,.0f} samples/s** at batch "
        f"size {best}; {limit.get(64, 0.0):,.0f} at 64, the servers' cap.",
        report.model_table(limit),
        "| server | batching | versions |\n|---|---|---|",
    ]
    parts[-1] += "".join(
        f"\n| {name} | {info['batching']} | "
        f"{', '.join(f'{k} {v}' for k, v in info['versions'].items())} |"  # type: ignore[attr-defined]
        for name, info in servers.items())
    if failures:
        parts.append("Did not run:\n" + "\n".join(f"- {k}: {v}" for k, v in failures.items()))
    parts.append("<details><summary>Every run</summary>\n\n" + report.runs_table(runs)
                 + "\n\n</details>")
    return "\n\n".join(parts)


def write(args: argparse.Namespace, result: dict[str, object]) -> str:
    runs: list[Run] = result["runs"]  # type: ignore[assignment]
    grid: list[float] = result["grid"]  # type: ignore[assignment]
    limit: dict[int, float] = result["model_limit"]  # type: ignore[assignment]
    summaries = [report.summarize(runs, name, grid) for name in result["servers"]]  # type: ignore[attr-defined]
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {**result, "runs": [r.as_dict() for r in runs],
           "summaries": [s.__dict__ for s in summaries]}
    shared = result.get("client") == "shared"
    doc["idles"] = [i.__dict__ for i in result.get("idles", [])]  # type: ignore[attr-defined]
    (args.out / ("peers-shared.json" if shared else "peers.json")).write_bytes(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    report.plot(runs, max(limit.values()), args.out / ("peers-shared.png" if shared
                                                        else "peers.png"))
    text = markdown(result, summaries)
    if args.doc:
        start, end = (SHARED_START, SHARED_END) if shared else (START, END)
        if args.block:
            start, end = f"<!-- {args.block}: start -->", f"<!-- {args.block}: end -->"
        page = Path(args.doc).read_text()
        head, _, rest = page.partition(start)
        _, _, tail = rest.partition(end)
        Path(args.doc).write_text(f"{head}{start}\n{text}\n{end}{tail}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        print(f"unknown server(s) {unknown}; known: {', '.join(PEERS)}", file=sys.stderr)
        return 2
    peers = [PEERS[n] for n in names]
    if args.from_json:
        print(write(args, load(args.from_json)))
        return 0
    make_shim()
    if args.install:
        install(peers)
        return 0
    missing = [p.name for p in peers if p.own_venv and not Path(p.python()).exists()]
    if missing:
        print(f"no venv for {missing}: run python -m benchmarks.peers --install", file=sys.stderr)
        return 2
    print(write(args, measure(args, peers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
