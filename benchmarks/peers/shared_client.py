"""The shared clients (``loadgen.py``, ``fastload.py``) as the sweep's load, one rate a process.

They live outside this project (``../shared/tools`` beside the checkout), written against no
server in particular, so a figure that holds with them is not an artefact of batchserve's own
load generator. ``loadgen.py`` (aiohttp, a pool of connections) drives rates up to
:data:`LOADGEN_UP_TO`; above it that client takes a whole core of the two and falls behind its
schedule, so the light ``fastload.py`` drives the higher rates and overload.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from batchserve.api.bench.load_result import LoadResult
from benchmarks.peers.peer import ROOT

TOOLS = ROOT.parent / "shared" / "tools"
LOADGEN_UP_TO = 2400.0
SLO_MS = 100.0
LOST = ("timeout", "closed", "connect_error", "client_backlog")
"""Statuses the shared clients give a request that got no HTTP answer."""


def tool_for(rate: float) -> str:
    return "loadgen.py" if rate <= LOADGEN_UP_TO else "fastload.py"


def run_shared(url: str, body: bytes, rate: float, seconds: float, seed: int,
               drain_s: float, tools: Path = TOOLS) -> LoadResult:
    """One open-loop run of the client :func:`tool_for` picks, as a :class:`LoadResult`."""
    command = [sys.executable, str(tools / tool_for(rate)), "--url", url,
               "--body", body.decode(), "--rate", f"{rate:g}", "--duration", f"{seconds:g}",
               "--slo-ms", f"{SLO_MS:g}", "--timeout", f"{drain_s:g}", "--seed", str(seed)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{tool_for(rate)} failed: {done.stderr.strip()[-400:]}")
    return from_report(json.loads(lines[-1]), rate, seconds)


def from_report(report: dict[str, object], rate: float, seconds: float) -> LoadResult:
    """A shared client's JSON line in the sweep's terms. Its percentiles cover OK answers
    only (``ok_p*``); ``answered`` counts every HTTP status, whatever it was."""
    status = {str(k): int(v) for k, v in report["status"].items()}  # type: ignore[attr-defined]
    sent = int(report["sent"])  # type: ignore[call-overload]
    ok = status.get("200", 0)
    lost = sum(status.get(k, 0) for k in LOST)
    cpu_s = float(report.get("client_cpu_frac") or 0.0) * seconds  # type: ignore[arg-type]
    goodput = float(report.get("goodput") or 0.0)  # type: ignore[arg-type]

    def ms(key: str) -> float | None:
        value = report.get(key)
        return None if value is None else float(value)  # type: ignore[arg-type]

    return LoadResult(
        target_rate=rate, seconds=seconds, sent=sent, answered=sent - lost, ok=ok,
        achieved_rate=ok / seconds, p50_ms=ms("p50_ms"), p90_ms=ms("p90_ms"),
        p99_ms=ms("p99_ms"), max_ms=ms("max_ms"),
        errors=(sent - ok) / sent if sent else 0.0,
        error_fraction={k: v / sent for k, v in status.items() if k != "200" and sent},
        timer_lag_p50_ms=None, timer_lag_p99_ms=ms("send_lag_p99_ms"),
        peak_connections=int(report.get("connections_opened") or 0),  # type: ignore[call-overload]
        peak_queued=status.get("client_backlog", 0),
        loadgen_cpu_s=cpu_s, loadgen_cpu_ms_per_req=cpu_s * 1e3 / sent if sent else 0.0,
        ok_p50_ms=ms("p50_ms"), ok_p90_ms=ms("p90_ms"), ok_p99_ms=ms("p99_ms"),
        refused_p99_ms=ms("p99_503_ms"), slo_ms=SLO_MS, good=round(goodput * seconds),
        goodput=goodput, offered_rate=rate,
        send_rate=float(report.get("send_rate") or sent / seconds),  # type: ignore[arg-type]
        status_counts=status,
    )
