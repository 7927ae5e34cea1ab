"""What each door costs: CPU per request of batchserve's gRPC and HTTP doors, their bare servers
and Triton's own gRPC endpoint, in one run at the same rates.

    flock /tmp/batchserve-bench.lock python -m benchmarks.grpc_cost --rates 1600,3200

For each target, one server is started fresh and driven at each rate (after a short warm-up)
on the bundled ``mlp``'s request, one row of 256 float32; the CPU of the server's whole process
tree (``batchserve.api.bench.cpu``: supervisor, API workers, runners; Triton's server and its
Python stubs) over the window, divided by the requests sent, is its cost:

- batchserve (bundled configuration, two API workers), on one server: ``ModelInfer`` with raw
  contents (load: ``../shared/tools/grpcload.py``), HTTP JSON (``fastload.py``) and HTTP with
  the binary tensor extension (this project's generator: fastload sends JSON only);
- the bare servers of ``../shared/tools/bare_fronts.py``, one process each with a trivial
  handler: ``grpc.aio`` (grpcload) and uvicorn + httptools (fastload);
- Triton through PyTriton (``benchmarks.peers.triton_mlp``, in ``.peers/triton``: install it
  with ``python -m benchmarks.peers --install --servers triton``), its gRPC endpoint driven by
  grpcload.

It writes the table between the ``grpc cost`` markers of ``docs/benchmarks.md`` (``--doc ''``:
none) and every window to ``--out``. ``--profile`` adds a window per rate on batchserve's gRPC
door with ``py-spy record --subprocesses`` attached, split into steps as
``benchmarks.request_path`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from batchserve.api.bench.bench import infer_body
from batchserve.api.bench.cpu import cpu_between, cpu_by_pid, server_cpu
from batchserve.api.bench.loadgen import loop_factory, run_load
from batchserve.api.bench.server import free_port, serve
from benchmarks import request_path
from benchmarks.live_table import replace_block
from benchmarks.peers.launch import started
from benchmarks.peers.peer import FEATURES, make_shim
from benchmarks.peers.shared_client import TOOLS

ROOT = Path(__file__).resolve().parent.parent
START = "<!-- grpc cost: start -->"
END = "<!-- grpc cost: end -->"
JSON_BODY = '{"inputs":[{"name":"x","shape":[1,256],"datatype":"FP32","data":__DATA__}]}'
SLO_MS = 100.0
PASS_NON_OK = 0.01
"""A rate passes when at most this share of requests is not OK and p99 of OK is ≤ SLO_MS."""


@dataclass(frozen=True)
class Window:
    """One target at one rate: what the client saw and what the server's processes spent."""

    target: str
    rate: float
    sent: int
    ok: int
    p99_ms: float | None
    cpu_s: float
    processes: int
    client_cpu_s: float | None = None
    refused: int = 0
    """Answers the server refused (gRPC UNAVAILABLE, HTTP 503): not OK, and not the client's."""

    @property
    def ms_per_request(self) -> float:
        return self.cpu_s * 1e3 / self.sent if self.sent else float("nan")

    @property
    def client_ms_per_request(self) -> float | None:
        if self.client_cpu_s is None or not self.sent:
            return None
        return self.client_cpu_s * 1e3 / self.sent

    @property
    def passed(self) -> bool:
        return (self.sent > 0 and self.sent - self.ok <= PASS_NON_OK * self.sent
                and self.p99_ms is not None and self.p99_ms <= SLO_MS)


Load = Callable[[float, float], dict[str, object]]
"""Drives a target at (rate, seconds); the client's figures: sent, ok, p99_ms, client_cpu_s."""


def _cpu_s(who: int) -> float:
    used = resource.getrusage(who)
    return used.ru_utime + used.ru_stime


def shared_tool(script: str, *args: str) -> Load:
    """A load tool of ``../shared/tools`` run once per window; its one JSON line back."""
    def load(rate: float, seconds: float) -> dict[str, object]:
        command = [sys.executable, str(TOOLS / script), *args, "--rate", f"{rate:g}",
                   "--duration", f"{seconds:g}"]
        before = _cpu_s(resource.RUSAGE_CHILDREN)  # the tool's own CPU, once it is reaped
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not done.stdout.strip():
            raise RuntimeError(f"{script} failed: {done.stderr.strip()[-500:]}")
        line: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
        refused = dict(line.get("codes") or line.get("status") or {})  # type: ignore[call-overload]
        return {**line, "client_cpu_s": _cpu_s(resource.RUSAGE_CHILDREN) - before,
                "refused": refused.get("UNAVAILABLE", refused.get("503", 0))}
    return load


def grpcload(target: str) -> Load:
    return shared_tool("grpcload.py", "--target", target, "--model", "mlp", "--input", "x",
                       "--width", str(FEATURES), "--slo-ms", f"{SLO_MS:g}")


def fastload(url: str) -> Load:
    return shared_tool("fastload.py", "--url", url, "--body", JSON_BODY, "--slo-ms",
                       f"{SLO_MS:g}")


def binary_load(url: str, runner: asyncio.Runner) -> Load:
    """This project's generator with the binary tensor extension, in this process."""
    body, headers = infer_body(1, FEATURES, binary=True)

    def load(rate: float, seconds: float) -> dict[str, object]:
        before = _cpu_s(resource.RUSAGE_SELF)
        result = runner.run(run_load(url, body, headers, rate, seconds, seed=7,
                                     slo_ms=SLO_MS))
        return {"sent": result.sent, "ok": result.ok, "p99_ms": result.ok_p99_ms,
                "client_cpu_s": _cpu_s(resource.RUSAGE_SELF) - before,
                "refused": result.status_counts.get("503", 0)}
    return load


def window(name: str, root: int, load: Load, rate: float, seconds: float) -> Window:
    before = server_cpu(root)
    seen = load(rate, seconds)
    cpu = cpu_between(before, server_cpu(root))
    p99, client = seen.get("p99_ms"), seen.get("client_cpu_s")
    return Window(name, rate, int(seen["sent"]), int(seen["ok"]),  # type: ignore[call-overload]
                  None if p99 is None else float(p99), cpu.seconds, cpu.processes,  # type: ignore[arg-type]
                  None if client is None else float(client),  # type: ignore[arg-type]
                  int(seen.get("refused") or 0))  # type: ignore[call-overload]


@contextlib.contextmanager
def bare(kind: str, log: Path) -> Iterator[tuple[int, int]]:
    """``bare_fronts.py KIND PORT`` in a session of its own; (port, pid), stopped after."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, str(TOOLS / "bare_fronts.py"), kind, str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_port(port, proc)
        yield port, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bare server exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:g} s")


class Session:
    """One run: every window, in order, with the rates and lengths they share."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rates = [float(r) for r in args.rates.split(",") if r.strip()]
        self.seconds, self.warmup = args.seconds, args.warmup
        self.out: Path = args.out
        self.windows: list[Window] = []
        self.profiles: dict[float, dict[str, dict[str, float]]] = {}

    def measure(self, root: int, loads: dict[str, Load]) -> None:
        for name, load in loads.items():
            if self.warmup:
                load(200.0, self.warmup)
            for rate in self.rates:
                found = window(name, root, load, rate, self.seconds)
                self.windows.append(found)
                print(f"{name} at {rate:g} req/s: {found.ms_per_request:.3f} ms/req, "
                      f"{found.ok}/{found.sent} ok, p99 {found.p99_ms} ms", flush=True)

    def profile(self, root: int, load: Load) -> None:
        """A window per rate with py-spy attached; µs of CPU per request by step."""
        for rate in self.rates:
            stacks = self.out / f"grpc-stacks-{rate:g}.txt"
            before = server_cpu(root)
            spy = request_path.spy(root, self.seconds + 1, stacks)
            seen = load(rate, self.seconds)
            cpu = cpu_by_pid(before, server_cpu(root))
            _, err = spy.communicate(timeout=self.seconds + 60)
            if spy.returncode != 0:
                raise RuntimeError(f"py-spy failed: {err.decode(errors='replace').strip()}")
            self.profiles[rate] = request_path.per_step(
                int(seen["sent"]), cpu, request_path.samples(stacks))  # type: ignore[call-overload]


BATCHSERVE = ("batchserve gRPC (ModelInfer, raw contents)", "batchserve HTTP JSON",
              "batchserve HTTP binary")
BARE = ("bare grpc.aio", "bare uvicorn + httptools")
TRITON = "Triton gRPC (PyTriton)"


def run_batchserve(session: Session, profile: bool) -> None:
    grpc_port = free_port()
    options = argparse.Namespace(port=0, config=ROOT / "configuration.yml", api_workers=2,
                                 ready_timeout=180.0)
    with serve(options, session.out / "batchserve.log", cwd=ROOT,
               extra=("--grpc-port", str(grpc_port))) as (base, root), \
            asyncio.Runner(loop_factory=loop_factory()) as runner:
        target = f"127.0.0.1:{grpc_port}"
        url = f"{base}/v2/models/mlp/infer"
        session.measure(root, dict(zip(BATCHSERVE, (grpcload(target), fastload(url),
                                                    binary_load(url, runner)), strict=True)))
        if profile:
            session.profile(root, grpcload(target))


def run_bare(session: Session) -> None:
    for name, kind in zip(BARE, ("grpc", "http"), strict=True):
        with bare(kind, session.out / f"bare-{kind}.log") as (port, pid):
            load = (grpcload(f"127.0.0.1:{port}") if kind == "grpc"
                    else fastload(f"http://127.0.0.1:{port}/v2/models/mlp/infer"))
            session.measure(pid, {name: load})


def run_triton(session: Session) -> None:
    from benchmarks.peers import model_limit, triton_mlp

    peer = triton_mlp.with_grpc(grpc_port := free_port())
    if not Path(peer.python()).exists():
        raise RuntimeError(f"no venv at {Path(peer.python()).parent.parent}: run python -m "
                           "benchmarks.peers --install --servers triton")
    make_shim()
    row = np.random.default_rng(0).standard_normal(FEATURES, dtype=np.float32).tolist()
    body = orjson.dumps(peer.body(row))
    with started(peer, body, model_limit.reference(row), session.out / "triton.log") as up:
        session.measure(up.pid, {TRITON: grpcload(f"127.0.0.1:{grpc_port}")})


def cost(windows: Sequence[Window], target: str, rate: float) -> float | None:
    found = [w.ms_per_request for w in windows if w.target == target and w.rate == rate]
    return found[0] if found else None


def _outcome(found: Window) -> str:
    p99 = "-" if found.p99_ms is None else f"{found.p99_ms:.1f}"
    refused = (f"; {100 * found.refused / found.sent:.0f}% refused"
               if found.refused and found.sent else "")
    return (f"{100 * found.ok / max(found.sent, 1):.1f}, {p99}"
            + ("" if found.passed else f" (fails{refused})"))


def markdown(session: Session, when: str) -> str:
    rates, windows = session.rates, session.windows
    head = ("| server and door | " + " | ".join(f"CPU ms/req at {r:,.0f}" for r in rates)
            + " | " + " | ".join(f"ok %, p99 ms at {r:,.0f}" for r in rates)
            + " | " + " | ".join(f"client CPU ms/req at {r:,.0f}" for r in rates) + " |")
    lines = [head, "|---|" + "---:|" * (3 * len(rates))]
    for target in dict.fromkeys(w.target for w in windows):
        cells = [f"{c:.3f}" if (c := cost(windows, target, r)) is not None else "-"
                 for r in rates]
        found = [next((w for w in windows if w.target == target and w.rate == r), None)
                 for r in rates]
        cells += ["-" if w is None else _outcome(w) for w in found]
        cells += ["-" if w is None or (c := w.client_ms_per_request) is None else f"{c:.3f}"
                  for w in found]
        lines.append(f"| {target} | " + " | ".join(cells) + " |")
    notes = [f"Measured {when}, {session.seconds:g} s a rate after a {session.warmup:g} s "
             f"warm-up at 200 req/s; a rate passes with at most {PASS_NON_OK:.0%} not OK and "
             f"p99 of OK answers within {SLO_MS:g} ms; the client's CPU is the load generator's "
             "own, on the same two cores."]
    for rate in rates:
        grpc_, bare_grpc = cost(windows, BATCHSERVE[0], rate), cost(windows, BARE[0], rate)
        http, bare_http = cost(windows, BATCHSERVE[1], rate), cost(windows, BARE[1], rate)
        if None not in (grpc_, bare_grpc, http, bare_http):
            notes.append(f"At {rate:,.0f} req/s the gRPC door adds {grpc_ - bare_grpc:.3f} ms "  # type: ignore[operator]
                         f"beyond its bare server; the HTTP door (JSON) {http - bare_http:.3f} "  # type: ignore[operator]
                         "beyond uvicorn's.")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {note}" for note in notes)


def profile_table(session: Session) -> str:
    return request_path.markdown(session.rates, session.profiles,
                                 {r: cost(session.windows, BATCHSERVE[0], r) or 0.0
                                  for r in session.rates})


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpc_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1600,3200", help="req/s, Poisson")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each window")
    p.add_argument("--warmup", type=float, default=3.0, help="s at 200 req/s before a target")
    p.add_argument("--targets", default="batchserve,bare,triton",
                   help="some of batchserve, bare, triton")
    p.add_argument("--profile", action="store_true",
                   help="one more window per rate on batchserve's gRPC door under py-spy")
    p.add_argument("--out", type=Path, default=Path("/tmp/batchserve-grpc-cost"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"),
                   help="markdown file whose grpc cost markers receive the table ('' for none)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    session = Session(args)
    targets = {t.strip() for t in args.targets.split(",") if t.strip()}
    if "batchserve" in targets:
        run_batchserve(session, args.profile)
    if "bare" in targets:
        run_bare(session)
    if "triton" in targets:
        run_triton(session)
    text = markdown(session, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if session.profiles:
        text += "\n\nWhere the gRPC door's CPU goes, µs per request (py-spy):\n\n"
        text += profile_table(session)
    print(text)
    saved = {"rates": session.rates, "seconds": session.seconds,
             "windows": [dataclasses.asdict(w) for w in session.windows],
             "profiles": session.profiles}
    (args.out / "grpc-cost.json").write_bytes(
        orjson.dumps(saved, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    if args.doc:
        replace_block(Path(args.doc), text, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
