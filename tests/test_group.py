"""Grouped batching end to end: the real server, runner processes and models that take one
value of a request parameter a call (`group_by`)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from batchserve.api.client import ModelClient
from batchserve.runner.core.config import ConfigError, parse
from tests.conftest import ROOT, Server, start_server
from tests.test_client import FRONTS, infer
from tests.test_server import histogram

CONFIG = """
api: {workers: 2}
runners:
  recase:
    model: batchserve.runner.bundled:recase
    batching: {max_batch_size: 64, max_latency_ms: 2000}
    group_by: {case: upper}
    inputs: [{name: text, datatype: BYTES, shape: [-1]}]
    outputs: [{name: recased, datatype: BYTES, shape: [-1]}]
  scaled:
    model: fixture_models:scaled
    batching: {max_batch_size: 16, max_latency_ms: 10000}
    group_by: [factor, shift]
    inputs: [{name: x, datatype: FP32, shape: [-1, 3]}]
    outputs:
      - {name: y, datatype: FP32, shape: [-1, 3]}
      - {name: rows, datatype: INT64, shape: [-1, 1]}
"""

KEYS = [(0.5, 0), (2.0, 0), (2.0, 7), (-1, 3)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("group")
    (folder / "configuration.yml").write_text(CONFIG)
    shutil.copy(ROOT / "tests" / "fixture_models.py", folder / "fixture_models.py")
    running = start_server(folder / "configuration.yml")
    yield running
    running.stop()


def scaled_body(x: np.ndarray, factor: float, shift: int) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                    "data": x.reshape(-1).tolist()}],
        "parameters": {"factor": factor, "shift": shift},
    }


def post_all(url: str, model: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """Every request at once, each on its own connection."""

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            return list(await asyncio.gather(
                *(client.post(f"/v2/models/{model}/infer", json=body) for body in bodies)
            ))

    return asyncio.run(run())


def outputs(answer: httpx.Response) -> dict[str, np.ndarray]:
    assert answer.status_code == 200, answer.text
    return {out["name"]: np.array(out["data"]).reshape(out["shape"])
            for out in answer.json()["outputs"]}


def batches(server: Server, runner: str) -> tuple[float, float]:
    """Batches run and rows they held, from /metrics."""
    page = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = histogram(page, "batchserve_adaptive_batch_size", runner=runner)
    return found.get("_count", 0.0), found.get("_sum", 0.0)


def test_concurrent_requests_of_several_groups_each_get_their_own_groups_answer(
    server: Server,
) -> None:
    rng = np.random.default_rng(5)
    sent = []
    for i in range(200):
        factor, shift = KEYS[i % len(KEYS)]
        rows = int(rng.integers(1, 41))  # past 16 the server splits it: every piece its group's
        x = rng.standard_normal((rows, 3)).astype(np.float32)
        sent.append((x, factor, shift))
    before, rows_before = batches(server, "scaled")
    answers = post_all(server.url, "scaled", [scaled_body(*item) for item in sent])
    for (x, factor, shift), answer in zip(sent, answers, strict=True):
        got = outputs(answer)
        np.testing.assert_allclose(got["y"], x * factor + shift, rtol=1e-6, atol=1e-6)
    after, rows_after = batches(server, "scaled")
    pieces = sum(-(-len(x) // 16) for x, _, _ in sent)
    assert rows_after - rows_before == sum(len(x) for x, _, _ in sent)
    assert after - before < pieces  # requests of one group did share batches


def test_the_bundled_recase_takes_one_case_a_batch_and_an_unknown_case_fails_alone(
    server: Server,
) -> None:
    words = [f"Word {i} of ÉTÉ" for i in range(90)]
    cases = ["upper", "lower", "title", "shout"]
    bodies = [{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [word]}],
               "parameters": {"case": cases[i % 4]}} for i, word in enumerate(words)]
    answers = post_all(server.url, "recase", bodies)
    for i, (word, answer) in enumerate(zip(words, answers, strict=True)):
        case = cases[i % 4]
        if case == "shout":
            assert answer.status_code == 500
            assert "ValueError: case 'shout' is not one of upper, lower, title" in answer.text
        else:
            assert outputs(answer)["recased"].tolist() == [getattr(word, case)()]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"factor": 2.0}, "runner 'scaled' batches requests by parameters factor, shift; the "
                          "request's parameters lack 'shift'"),
        ({"factor": [2], "shift": 0}, "parameters.factor has value [2]; expected a string, a "
                                      "number or a boolean"),
        ({"factor": None, "shift": 0}, "parameters.factor has value None; expected a string"),
    ],
)
def test_a_request_without_its_group_values_is_told_which(
    server: Server, parameters: dict[str, Any], message: str
) -> None:
    body = scaled_body(np.ones((1, 3), np.float32), 1.0, 0)
    body["parameters"] = parameters
    answer = httpx.post(f"{server.url}/v2/models/scaled/infer", json=body, timeout=10)
    assert answer.status_code == 400 and message in answer.json()["error"]


@pytest.mark.parametrize(
    ("group_by", "message"),
    [
        ("[x]", "runners.g.group_by[0] has value 'x', also an input's name"),
        ("[a, a]", "runners.g.group_by[1] has value 'a', named twice"),
        ("[timeout]", "runners.g.group_by[0] has value 'timeout', a parameter the server reads"),
        ("[1-2]", "runners.g.group_by[0] has value '1-2'; it must be a Python identifier"),
        ("{a: [1]}", "runners.g.group_by.a has value [1]; it must be a string, a number"),
        ("a", "runners.g.group_by has value 'a'; it must be a list of request parameter names"),
    ],
)
def test_group_by_is_checked_when_the_configuration_loads(group_by: str, message: str) -> None:
    text = CONFIG.split("  recase:")[0] + f"""  g:
    model: fixture_models:scaled
    group_by: {group_by}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 3]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 3]}}]
"""
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse(yaml.safe_load(text))


@pytest.mark.parametrize("front", FRONTS)
def test_the_python_client_sends_the_group_values_with_every_chunk(
    server: Server, front: str
) -> None:
    x = np.random.default_rng(8).standard_normal((50, 3)).astype(np.float32)  # 4 chunks of 16
    got = infer(front, server.url, "scaled", x=x, parameters={"factor": 3.0, "shift": -2})
    np.testing.assert_allclose(got["y"], x * 3.0 - 2, rtol=1e-6, atol=1e-6)
    assert got["rows"].max() <= 16


def test_the_python_client_refuses_a_parameter_it_cannot_send(server: Server) -> None:
    with ModelClient(server.url, "scaled") as client, pytest.raises(
        ValueError, match="parameter 'factor' is a list; expected a string, a number or a boolean"
    ):
        client.infer_batch(x=np.ones((1, 3), np.float32), parameters={"factor": [1], "shift": 0})
