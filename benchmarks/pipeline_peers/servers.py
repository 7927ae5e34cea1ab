"""The two servers of the comparison, started fresh and checked, and what is sent to them.

batchserve runs on the bundled `configuration.yml` (its one API worker, no gRPC door) and
serves the pipeline `classify` and its steps `tokenize` and `text`; mosec runs
`mosec_classify.py` from its own venv (`.peers/mosec/`), importing batchserve's model code
through the peers' shim. Each must first answer the request with the scores the model
computes in this process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from batchserve.api.bench.scrape import Scrape, fetch
from batchserve.api.bench.server import free_port
from benchmarks.peers.launch import ask, stop, wait_answer
from benchmarks.peers.peer import ROOT, SHIM, VENVS, make_shim

TEXT = "the quick brown fox jumps over the lazy dog"
"""The one string every request classifies: nine words, ten token ids."""
TOLERANCE = 1e-5
READY_S = 180.0  # a fresh server's start-up, model loads included


def v2_text(text: str = TEXT) -> bytes:
    return orjson.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                     "data": [text]}]})


def v2_tokens(ids: list[int]) -> bytes:
    return orjson.dumps({"inputs": [{"name": "tokens", "datatype": "INT64",
                                     "shape": [len(ids)], "data": ids}]})


def follow(answer: bytes) -> bytes:
    """The `text` call made of a `tokenize` answer: its ids, as they came."""
    out = orjson.loads(answer)["outputs"][0]
    return orjson.dumps({"inputs": [{"name": "tokens", "datatype": "INT64",
                                     "shape": out["shape"], "data": out["data"]}]})


def reference() -> tuple[list[int], list[float]]:
    """The string's token ids and class scores, computed here by batchserve's own code."""
    import numpy as np
    import torch

    from batchserve.runner.bundled import tokenize
    from batchserve.runner.text_model import RaggedText

    ids = tokenize(np.array([TEXT.encode()], dtype=object))["tokens"][0]
    with torch.inference_mode():
        scores = RaggedText()(torch.from_numpy(ids), torch.tensor([len(ids)]))
    return [int(i) for i in ids], [float(s) for s in scores[0]]


@dataclass(frozen=True)
class Kind:
    """How to start one server and read it: its command line, the request and the path of
    the scores in the answer, and where its first step's rows and batches are counted."""

    name: str
    python: Callable[[], str]
    argv: Callable[[str, int], list[str]]
    path: str
    body: bytes
    scores: Callable[[object], list[float]]
    step1: Callable[[Scrape], tuple[float, float]]
    own_venv: bool  # a peer's, with the shim first on its import path


def _environment(own_venv: bool) -> dict[str, str]:
    shim = [str(SHIM)] if own_venv else []
    paths = [*shim, str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _batchserve_argv(python: str, port: int) -> list[str]:
    script = str(Path(python).with_name("batchserve"))
    return [script, "serve", "--config", str(ROOT / "configuration.yml"), "--port", str(port),
            "--grpc-port", "0"]


def _batchserve_step1(scrape: Scrape) -> tuple[float, float]:
    name = "batchserve_adaptive_batch_size"
    return (scrape.total(f"{name}_sum", runner="tokenize"),
            scrape.total(f"{name}_count", runner="tokenize"))


def wasted_counter(scrape: Scrape) -> float:
    """The server's own count of the rows its first step ran for nothing."""
    return scrape.total("batchserve_pipeline_wasted_rows_total", pipeline="classify",
                        step="0", runner="tokenize")


def runner_refusals(before: Scrape, after: Scrape) -> dict[str, float]:
    """The requests each step's runner refused itself (at their arrival, or expired in its
    queue) between two readings: for `text`, after `tokenize` ran them."""
    name = "batchserve_rejections_total"
    return {runner: after.total(name, runner=runner) - before.total(name, runner=runner)
            for runner in ("tokenize", "text")}


def _mosec_step1(scrape: Scrape) -> tuple[float, float]:
    name = "mosec_service_batch_size"
    return (scrape.total(f"{name}_sum", stage="Tokenize_1"),
            scrape.total(f"{name}_count", stage="Tokenize_1"))


def batchserve() -> Kind:
    return Kind("batchserve", lambda: sys.executable, _batchserve_argv,
                "/v2/models/classify/infer", v2_text(),
                lambda reply: reply["outputs"][0]["data"],  # type: ignore[index]
                _batchserve_step1, own_venv=False)


def mosec(max_batch_size: int, max_wait_ms: int) -> Kind:
    def argv(python: str, port: int) -> list[str]:
        return [python, "-m", "benchmarks.pipeline_peers.mosec_classify",
                "--max-batch-size", str(max_batch_size), "--max-wait-ms", str(max_wait_ms),
                "--port", str(port), "--address", "127.0.0.1", "--log-level", "warning"]

    return Kind("mosec", lambda: str(VENVS / "mosec" / "bin" / "python"), argv, "/inference",
                orjson.dumps({"text": TEXT}), lambda reply: reply["scores"],  # type: ignore[index]
                _mosec_step1, own_venv=True)


@dataclass(frozen=True)
class Running:
    base: str  # http://127.0.0.1:PORT
    url: str  # where the request goes
    pid: int  # the process whose tree's CPU is counted
    kind: Kind

    def step1(self) -> tuple[float, float]:
        return self.kind.step1(fetch(self.base))


@contextlib.contextmanager
def started(kind: Kind, expected: list[float], log: Path) -> Iterator[Running]:
    """``kind`` on a free port, checked on the request; stopped with all its processes after."""
    make_shim()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with log.open("ab") as out:
        proc = subprocess.Popen(kind.argv(kind.python(), port), env=_environment(kind.own_venv),
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        check(kind, wait_answer(kind.name, base + kind.path, kind.body, proc, READY_S),
              expected)
        yield Running(base, base + kind.path, proc.pid, kind)
    finally:
        stop(proc)


def check(kind: Kind, reply: object, expected: list[float]) -> None:
    got = [float(v) for v in kind.scores(reply)]
    worst = max((abs(g - e) for g, e in zip(got, expected, strict=False)), default=1.0)
    if len(got) != len(expected) or worst > TOLERANCE:
        raise RuntimeError(f"{kind.name} answered {got}, not the model's {expected}")


def ask_steps(base: str, ids: list[int], expected: list[float]) -> None:
    """The two steps called alone answer what the pipeline does."""
    tokens = ask(f"{base}/v2/models/tokenize/infer", v2_text())
    got_ids = tokens["outputs"][0]["data"]  # type: ignore[index]
    if got_ids != ids:
        raise RuntimeError(f"tokenize answered {got_ids}, not {ids}")
    scores = ask(f"{base}/v2/models/text/infer", v2_tokens(ids))
    got = scores["outputs"][0]["data"]  # type: ignore[index]
    if max(abs(g - e) for g, e in zip(got, expected, strict=True)) > TOLERANCE:
        raise RuntimeError(f"text answered {got}, not {expected}")
