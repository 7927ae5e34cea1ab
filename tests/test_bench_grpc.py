"""`batchserve bench --protocol grpc` against the real server's gRPC door: every bundled model
loaded through ModelInfer with raw contents, failures counted under the HTTP status of the same
decision, and a target that does not answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchserve.api.bench import bench, traffic
from tests.conftest import ROOT, Server, free_port, start_server

MODELS = ("iris_clf", "mlp", "text_features", "text")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    served = start_server(ROOT / "configuration.yml", "--grpc-port", str(free_port()))
    yield served
    served.stop()


@pytest.mark.parametrize("model", MODELS)
def test_every_bundled_model_is_loaded_over_grpc(
    server: Server, model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "report.json"
    argv = ["--url", server.url, "--protocol", "grpc", "--grpc-target", server.grpc,
            "--model", model, "--rate", "30", "--seconds", "0.5", "--json", str(path)]
    assert bench.main(argv) == 0
    assert capsys.readouterr().err == ""
    (step,) = json.loads(path.read_text())["steps"]
    scheduled = len(traffic.schedule(30, 0.5, seed=0))
    assert step["status_counts"] == {"200": scheduled} and step["ok"] == scheduled
    assert step["mean_batch_size"] >= 1.0  # the runner's own count: the calls reached it
    assert step["ok_p50_ms"] <= step["ok_p99_ms"]


def test_the_grpc_target_defaults_to_port_8001_of_the_urls_host() -> None:
    args = bench._parser().parse_args(["--url", "http://127.0.0.1:3000", "--protocol", "grpc"])
    assert args.grpc_target is None and bench.GRPC_PORT == 8001


def test_every_call_failing_exits_non_zero_with_its_status_and_words(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--url", server.url, "--protocol", "grpc", "--grpc-target", server.grpc,
            "--model", "iris_clf", "--parameter", "timeout=-1", "--rate", "20",
            "--seconds", "0.3"]
    assert bench.main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    (sample,) = [line for line in err if line.startswith("sample answer with status 400: ")]
    assert "INVALID_ARGUMENT" in sample and "parameters.timeout has value -1" in sample
    assert err[-1].startswith("batchserve bench: every request failed; the first answer: 400 ")


def test_a_grpc_target_that_does_not_answer_fails(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--url", server.url, "--protocol", "grpc", "--grpc-target",
            f"127.0.0.1:{free_port()}", "--model", "iris_clf", "--rate", "20",
            "--seconds", "0.3"]
    assert bench.main(argv) == 1
    assert "every request failed; the first answer: transport cannot connect to" in (
        capsys.readouterr().err)
