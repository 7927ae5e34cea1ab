"""The two independent load clients of the live table, behind one small interface.

- ``batchserve``: this project's open-loop generator (``batchserve.api.bench.loadgen.run_load``), in
  process.
- ``shared``: ``../shared/tools/loadgen.py``, an aiohttp + uvloop generator with up to 2,000
  connections, run as a subprocess that prints one JSON line.

A result that holds under both is not an artefact of one client. Both count latency from
each request's scheduled send time; both report their own send lag (how late the client sent),
which is inside every latency they report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from batchserve.api.bench.bench import infer_body
from batchserve.api.bench.load_result import LoadResult
from batchserve.api.bench.loadgen import run_load

SLO_MS = 100.0
MAX_NON_OK = 0.01
SHARED_BODY = '{"inputs":[{"name":"x","shape":[1,256],"datatype":"FP32","data":__DATA__}]}'


@dataclass(frozen=True)
class RunResult:
    """One client's run at one rate. Latencies are of the OK (200) answers only."""

    client: str
    rate: float
    seconds: float
    sent: int
    ok: int
    refused: int  # 503 answers
    other: int  # any other status, transport errors, timeouts
    p50_ms: float | None
    p99_ms: float | None
    refused_p99_ms: float | None
    send_lag_p99_ms: float | None
    good: int  # OK answers within the client's slo_ms (SLO_MS unless told)
    client_cpu_s: float
    raw: dict[str, object] = field(repr=False)

    @property
    def non_ok(self) -> float:
        return (self.sent - self.ok) / self.sent if self.sent else 1.0

    def share(self, count: int) -> float | None:
        """`count` as a share of the requests sent (None when none was)."""
        return count / self.sent if self.sent else None

    @property
    def late(self) -> float | None:
        """The share of requests answered 200 after the client's SLO (fastload gives its good
        answers as a rate rounded to 0.1 a second, so their count can pass the 200s by one)."""
        return self.share(max(0, self.ok - self.good))

    @property
    def goodput(self) -> float:
        """OK answers within the SLO per second of sending."""
        return self.good / self.seconds

    @property
    def passed(self) -> bool:
        """At most 1% of requests without a 200, and the p99 of the 200s within 100 ms."""
        return self.non_ok <= MAX_NON_OK and self.p99_ms is not None and self.p99_ms <= SLO_MS

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "non_ok": self.non_ok, "goodput": self.goodput,
                "passed": self.passed}


class Client(Protocol):
    name: str

    def run(self, url: str, rate: float, seconds: float, seed: int) -> RunResult: ...

    def overload(
        self, url: str, high: tuple[float, float], low: tuple[float, float], gap: float, seed: int
    ) -> tuple[RunResult, RunResult, float]:
        """``high`` (rate, seconds), then ``low`` starting ``gap`` s after the high one stops
        sending; returns both results and the client's start-up lag for the second (0 when
        both run in this process)."""
        ...


# -- batchserve's own generator


def from_load(client: str, load: LoadResult) -> RunResult:
    statuses = {k: round(v * load.sent) for k, v in load.error_fraction.items()}
    refused = statuses.pop("503", 0)
    return RunResult(
        client=client, rate=load.target_rate, seconds=load.seconds, sent=load.sent, ok=load.ok,
        refused=refused, other=load.sent - load.ok - refused, p50_ms=load.ok_p50_ms,
        p99_ms=load.ok_p99_ms, refused_p99_ms=load.refused_p99_ms,
        send_lag_p99_ms=load.timer_lag_p99_ms, good=load.good, client_cpu_s=load.loadgen_cpu_s,
        raw=load.as_dict(),
    )


class OwnClient:
    """``batchserve.api.bench.loadgen.run_load`` on the caller's event loop runner, JSON bodies of
    one row; answers within ``slo_ms`` count as good."""

    name = "batchserve"

    def __init__(self, runner: asyncio.Runner, slo_ms: float = SLO_MS) -> None:
        self._runner, self._slo_ms = runner, slo_ms
        self._body, self._headers = infer_body(1, 256, binary=False)

    def _load(self, url: str, rate: float, seconds: float, seed: int) -> asyncio.Task[LoadResult]:
        load = run_load(url, self._body, self._headers, rate, seconds, seed,
                        slo_ms=self._slo_ms)
        return asyncio.ensure_future(load)

    def run(self, url: str, rate: float, seconds: float, seed: int) -> RunResult:
        async def one() -> LoadResult:
            return await self._load(url, rate, seconds, seed)

        return from_load(self.name, self._runner.run(one()))

    def overload(
        self, url: str, high: tuple[float, float], low: tuple[float, float], gap: float, seed: int
    ) -> tuple[RunResult, RunResult, float]:
        async def both() -> tuple[LoadResult, LoadResult]:
            first = self._load(url, *high, seed)
            await asyncio.sleep(high[1] + gap)  # both runs schedule from their own start
            second = self._load(url, *low, seed + 1)
            return await first, await second

        over, after = self._runner.run(both())
        return from_load(self.name, over), from_load(self.name, after), 0.0


# -- the shared aiohttp generator


def from_shared(line: dict[str, object], rate: float, seconds: float,
                client: str = "shared") -> RunResult:
    """A :class:`RunResult` from a shared client's JSON line."""
    sent, ok = int(line["sent"]), int(line["ok"])  # type: ignore[call-overload]
    refused = int(line["n_503"])  # type: ignore[call-overload]
    if "good_frac" in line:  # loadgen.py; fastload.py gives the rate of good answers instead
        good = round(float(line["good_frac"] or 0.0) * sent)  # type: ignore[arg-type]
    else:
        good = round(float(line["goodput"] or 0.0) * seconds)  # type: ignore[arg-type]
    cpu_frac = float(line["client_cpu_frac"])  # type: ignore[arg-type]
    return RunResult(
        client=client, rate=rate, seconds=seconds, sent=sent, ok=ok, refused=refused,
        other=sent - ok - refused, p50_ms=line["p50_ms"], p99_ms=line["p99_ms"],  # type: ignore[arg-type]
        refused_p99_ms=line["p99_503_ms"], send_lag_p99_ms=line["send_lag_p99_ms"],  # type: ignore[arg-type]
        good=good, client_cpu_s=cpu_frac * float(line["wall_s"]),  # type: ignore[arg-type]
        raw=line,
    )


class SharedClient:
    """A client from the shared tools (``loadgen.py`` unless told ``fastload.py``, which takes
    the same arguments and prints the same line), one subprocess per run, no warm-up requests;
    answers within ``slo_ms`` count as good."""

    def __init__(self, script: Path, python: str = sys.executable, timeout: float = 2.0,
                 name: str = "shared", slo_ms: float = SLO_MS) -> None:
        if not script.is_file():
            raise RuntimeError(f"shared client not found at {script}")
        self._script, self._python, self._timeout = script, python, timeout
        self.name, self._slo_ms = name, slo_ms

    def _command(self, url: str, rate: float, seconds: float, seed: int) -> list[str]:
        return [
            self._python, str(self._script), "--url", url, "--body", SHARED_BODY,
            "--rate", f"{rate:g}", "--duration", f"{seconds:g}", "--slo-ms", f"{self._slo_ms:g}",
            "--timeout", f"{self._timeout:g}", "--seed", str(seed),
            *(["--warmup", "0"] if self._script.name == "loadgen.py" else []),
        ]

    def _start(self, url: str, rate: float, seconds: float, seed: int) -> subprocess.Popen[str]:
        cmd = self._command(url, rate, seconds, seed)
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def _finish(self, proc: subprocess.Popen[str], seconds: float) -> dict[str, object]:
        out, err = proc.communicate(timeout=seconds + self._timeout + 60)
        lines = out.strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"shared loadgen failed ({proc.returncode}): {err.strip()[-500:]}")
        return json.loads(lines[-1])  # type: ignore[no-any-return]

    def run(self, url: str, rate: float, seconds: float, seed: int) -> RunResult:
        line = self._finish(self._start(url, rate, seconds, seed), seconds)
        return from_shared(line, rate, seconds, self.name)

    def overload(
        self, url: str, high: tuple[float, float], low: tuple[float, float], gap: float, seed: int
    ) -> tuple[RunResult, RunResult, float]:
        """Two subprocesses; the second is launched ``high`` seconds + ``gap`` after the first.

        Each one's clock starts only after its interpreter has started, so the gap holds to
        within the difference of the two start-ups. The recovery one's start-up is measured
        (its exit time less its own wall time, less its launch time: it closes few
        connections, so little follows its ``wall_s``) and returned as the third value.
        """
        began = time.monotonic()
        first = self._start(url, *high, seed)
        time.sleep(max(0.0, began + high[1] + gap - time.monotonic()))
        launched = time.monotonic()
        second = self._start(url, *low, seed + 1)
        exits = wait_all([first, second], max(high[1], low[1]) + self._timeout + 60)
        over = self._finish(first, high[1])
        after = self._finish(second, low[1])
        startup = exits[1] - float(after["wall_s"]) - launched  # type: ignore[arg-type]
        return from_shared(over, *high), from_shared(after, *low), startup


def wait_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[float]:
    """Wait for every process; return each one's exit time (monotonic, to within 10 ms).

    Pipes are drained as they fill by reading them after exit, which is safe because each
    process writes one short JSON line and little else.
    """
    exits: list[float | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout
    while any(e is None for e in exits):
        if time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"shared loadgen still running after {timeout:g} s")
        for i, proc in enumerate(procs):
            if exits[i] is None and proc.poll() is not None:
                exits[i] = time.monotonic()
        time.sleep(0.01)
    return [e for e in exits if e is not None]


def add_run_options(p: argparse.ArgumentParser, doc_start: str, doc_end: str) -> None:
    """The options every live check shares: warm-up, the server's API workers, the shared
    clients and their interpreter, and where the figures go."""
    p.add_argument("--warmup-seconds", type=float, default=3.0,
                   help="at the same rate, same client, before each measured run")
    p.add_argument("--api-workers", type=int, default=2)
    p.add_argument("--shared-tools", type=Path,
                   default=Path(__file__).resolve().parent.parent.parent / "shared" / "tools",
                   help="the folder holding the shared load generators")
    p.add_argument("--shared-python", default=sys.executable, help="interpreter for them")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--json", type=Path, help="write every figure to this file")
    p.add_argument("--doc", type=Path, help="also put the tables into this file, between the "
                   f"lines {doc_start!r} and {doc_end!r}")
