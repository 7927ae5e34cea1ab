"""PyTriton's `ModelClient` through the real server, from a venv of its own.

nvidia-pytriton pins numpy below 2, so its client runs in `.peers/pytriton/` (git-ignored),
which this test creates with pip when it is missing (a few hundred MB, once), or in the
interpreter `BATCHSERVE_PYTRITON_PYTHON` names. `tests/pytriton_check.py` runs there; its
outputs must equal what the server answers batchserve's own requests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import ROOT, Server, start_server

PYTRITON = "nvidia-pytriton==0.7.0"
VENV = ROOT / ".peers" / "pytriton"
CHECK = ROOT / "tests" / "pytriton_check.py"


def pytriton_python() -> str:
    """The interpreter with nvidia-pytriton: the one named by the environment, or our venv,
    made now if it is missing."""
    named = os.environ.get("BATCHSERVE_PYTRITON_PYTHON")
    if named:
        return named
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", PYTRITON], check=True)
    return str(python)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = start_server(ROOT / "configuration.yml", "--api-workers", "1")
    yield running
    running.stop()


def ours(server: Server, model: str, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """The server's answer to batchserve's own JSON request, output by output."""
    answer = httpx.post(f"{server.url}/v2/models/{model}/infer", json={"inputs": inputs})
    assert answer.status_code == 200, answer.text
    return {out["name"]: out for out in answer.json()["outputs"]}


def same(theirs: dict[str, Any], answer: dict[str, Any], shape: list[int] | None = None
         ) -> None:
    assert set(theirs) == set(answer)
    for name, output in theirs.items():
        assert output["shape"] == (shape or answer[name]["shape"]), name
        if isinstance(output["data"][0], str):
            assert output["data"] == answer[name]["data"], name
        else:
            np.testing.assert_allclose(output["data"], answer[name]["data"], rtol=1e-6)


def test_pytriton_model_client_infers_every_kind_of_bundled_model(server: Server) -> None:
    run = subprocess.run([pytriton_python(), str(CHECK), server.url], capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["iris_clf_batching"] is True and found["iris_clf_max_batch_size"] == 100
    flowers = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]
    iris = ours(server, "iris_clf", [{"name": "input", "datatype": "FP32", "shape": [2, 4],
                                      "data": flowers}])
    same(found["iris_clf_batch"], iris)
    second = ours(server, "iris_clf", [{"name": "input", "datatype": "FP32", "shape": [1, 4],
                                        "data": flowers[1]}])
    same(found["iris_clf_sample"], second, shape=[3])
    rows = np.linspace(-1, 1, 3 * 256, dtype=np.float32)
    same(found["mlp_batch"], ours(server, "mlp", [
        {"name": "x", "datatype": "FP32", "shape": [3, 256], "data": rows.tolist()}]))
    same(found["text_features_sample"], ours(server, "text_features", [
        {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a,b,,c", "naïve,café"]},
        {"name": "separator", "datatype": "BYTES", "shape": [1], "data": [","]}]))
    same(found["text_sample"], ours(server, "text", [
        {"name": "tokens", "datatype": "INT64", "shape": [5], "data": [1, 2, 3, 4, 5]}]))
