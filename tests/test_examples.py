"""The example models of `examples/models.yml`: deterministic, the same alone as in a batch,
and served by a real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from batchserve.api import cli
from batchserve.api.bench import bench
from batchserve.api.client import ModelClient
from batchserve.runner.core.config import load
from batchserve.runner.encoder import LONGEST, Encoder
from batchserve.runner.vision import ResNet

from .conftest import ROOT, Server, start_server

CONFIG = ROOT / "examples" / "models.yml"


def images(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((count, 3, 224, 224), dtype=np.float32)


def run(model: torch.nn.Module, *arrays: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = model(*(torch.from_numpy(a) for a in arrays)).numpy()
    return out


def ragged(sequences: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A batch as the runner joins it: the ids concatenated and where each sequence ends."""
    return np.concatenate(sequences), np.cumsum([len(s) for s in sequences])


def test_resnet_answers_the_same_in_every_process_and_alone_as_in_a_batch() -> None:
    batch = images(3)
    first, second = ResNet(), ResNet()
    together = run(first, batch)
    assert together.shape == (3, 1000) and together.dtype == np.float32
    np.testing.assert_array_equal(together, run(second, batch))  # fixed-seed weights
    np.testing.assert_array_equal(together, run(first, batch))  # deterministic
    for row in range(3):  # a batch's convolutions may round differently, by a few ulps
        np.testing.assert_allclose(run(first, batch[row:row + 1])[0], together[row],
                                   rtol=1e-5, atol=1e-6)
    assert np.abs(together[0] - together[1]).max() > 1e-3  # different images, different scores


def test_resnet_scales_uint8_pixels_to_the_fp32_range() -> None:
    pixels = np.random.default_rng(1).integers(0, 256, (2, 3, 224, 224), dtype=np.uint8)
    model = ResNet()
    np.testing.assert_allclose(run(model, pixels), run(model, pixels / np.float32(255)),
                               rtol=1e-5, atol=1e-6)


def test_encoder_answers_each_sequence_alone_as_in_a_ragged_batch() -> None:
    rng = np.random.default_rng(2)
    sequences = [rng.integers(0, 1 << 40, n) for n in (1, 7, 64, LONGEST)]
    first, second = Encoder(), Encoder()
    together = run(first, *ragged(sequences))
    assert together.shape == (4, 256) and together.dtype == np.float32
    np.testing.assert_array_equal(together, run(second, *ragged(sequences)))
    for row, sequence in enumerate(sequences):
        np.testing.assert_allclose(run(first, *ragged([sequence]))[0], together[row],
                                   rtol=1e-5, atol=1e-6)


def test_encoder_cuts_a_sequence_at_its_longest() -> None:
    long = np.random.default_rng(3).integers(0, 1000, LONGEST + 40)
    model = Encoder()
    np.testing.assert_array_equal(run(model, *ragged([long])),
                                  run(model, *ragged([long[:LONGEST]])))


def test_the_example_configuration_validates(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(CONFIG)]) == 0  # every model imports
    assert capsys.readouterr().out.endswith(
        "valid (3 runner(s): resnet, resnet_uint8, encoder)\n")
    config = load(CONFIG)
    assert list(config.runners) == ["resnet", "resnet_uint8", "encoder"]
    assert config.runners["resnet"].batching.max_latency_ms == 300
    assert config.runners["encoder"].max_cost == 2048


def relaxed(folder: Path) -> Path:
    """The example configuration with limits that a machine busy with other work still meets
    (a 413 would say nothing of the models), and without its second image runner."""
    document = yaml.safe_load(CONFIG.read_text())
    del document["runners"]["resnet_uint8"]
    for runner in document["runners"].values():
        runner["batching"]["max_latency_ms"] = 20_000
    path = folder / "models.yml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(relaxed(tmp_path_factory.mktemp("examples")), "--api-workers", "1")
    yield server
    server.stop()


def test_a_server_on_the_examples_answers_an_image_and_a_sequence(examples: Server) -> None:
    image = images(1, seed=4)
    with ModelClient(examples.url, "resnet", timeout_s=30) as client:  # binary tensors
        scores = client.infer_batch(images=image)["scores"]
    np.testing.assert_allclose(scores, run(ResNet(), image), rtol=1e-5, atol=1e-6)
    tokens = np.arange(100, 150, dtype=np.int64)
    with examples.client() as client:  # JSON
        answer = client.post("/v2/models/encoder/infer", json={"inputs": [
            {"name": "tokens", "datatype": "INT64", "shape": [50], "data": tokens.tolist()}]})
    assert answer.status_code == 200, answer.text
    out = answer.json()["outputs"][0]
    assert out["shape"] == [1, 256]
    np.testing.assert_allclose(np.array(out["data"], np.float32),
                               run(Encoder(), *ragged([tokens]))[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("model", "flags"), [("resnet", ["--binary"]), ("encoder", [])])
def test_the_bench_loads_the_example_models(examples: Server, model: str, flags: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", examples.url, "--model", model, "--rate", "4", "--seconds", "0.5",
            "--json", *flags]
    assert bench.main(argv) == 0
    (step,) = json.loads(capsys.readouterr().out)["steps"]
    assert step["sent"] == step["status_counts"]["200"] > 0
