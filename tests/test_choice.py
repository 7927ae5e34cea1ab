"""The choice of a runner process: pure functions with a seeded random source, the
configuration key, and `least_loaded_of_two` in a real server."""

from __future__ import annotations

import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from batchserve.api.choice import CHOOSERS, least_loaded_of_two, uniform
from batchserve.runner.core.config import CHOICES, ConfigError, load
from tests.conftest import Server
from tests.test_config import GOOD
from tests.test_server import PID_OUTPUTS


def no_load(i: int) -> int:
    raise AssertionError("the random choice looked at a load")


def test_every_choice_has_a_chooser() -> None:
    assert set(CHOOSERS) == set(CHOICES) == {"random", "least_loaded_of_two"}


def test_random_draws_uniformly_and_never_looks_at_the_load() -> None:
    rng, same = random.Random(7), random.Random(7)
    assert [uniform(5, no_load, rng) for _ in range(50)] == [same.randrange(5) for _ in range(50)]
    assert uniform(1, no_load, rng) == 0


@pytest.mark.parametrize("seed", range(20))
def test_least_loaded_of_two_takes_the_lighter_of_the_two_drawn(seed: int) -> None:
    loads = [4, 0, 9, 4, 2]
    rng, same = random.Random(seed), random.Random(seed)
    for _ in range(30):
        first, second = same.sample(range(len(loads)), 2)
        expected = second if loads[second] < loads[first] else first  # a tie: the first
        assert least_loaded_of_two(len(loads), loads.__getitem__, rng) == expected


def test_least_loaded_of_two_of_two_is_the_lighter_one() -> None:
    rng = random.Random(3)
    assert {least_loaded_of_two(2, [5, 1].__getitem__, rng) for _ in range(100)} == {1}
    assert least_loaded_of_two(1, no_load, rng) == 0


def test_least_loaded_of_two_never_takes_the_heaviest_and_spreads_the_rest() -> None:
    """Of four processes loaded 0..3, the idle one is in half the pairs drawn and the busiest
    is never taken; each draw is a seeded coin, so the counts are exact for this seed."""
    rng = random.Random(11)
    counts = Counter(least_loaded_of_two(4, lambda i: i, rng) for _ in range(6000))
    assert counts[3] == 0
    assert 2700 < counts[0] < 3300 and 1700 < counts[1] < 2300 and 700 < counts[2] < 1300


def test_the_choice_is_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(GOOD)
    assert load(path).runners["iris_clf"].choice == "random"
    path.write_text(GOOD.replace("    batching:", "    choice: least_loaded_of_two\n    batching:"))
    assert load(path).runners["iris_clf"].choice == "least_loaded_of_two"
    path.write_text(GOOD.replace("    batching:", "    choice: fastest\n    batching:"))
    with pytest.raises(ConfigError, match="^runners.iris_clf.choice has value 'fastest'; it "
                       "must be one of random, least_loaded_of_two$"):
        load(path)


CONFIG = f"""
runners:
  slow:
    model: fixture_models:slow_pid_echo
    workers: 2
    choice: least_loaded_of_two
    batching: {{max_batch_size: 1, max_latency_ms: 10000}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{PID_OUTPUTS}]
"""
ROUNDS = 8


def test_least_loaded_of_two_sends_a_second_request_to_the_idle_process(serve: object) -> None:
    """Two runner processes, each holding a request for 300 ms: of two requests sent at once,
    the second goes to the process the first left idle, every round. Drawn at random, both
    would land on one process in half the rounds."""
    server: Server = serve(CONFIG, "--api-workers", "1")  # type: ignore[operator]
    assert len(server.runners()) == 2
    together = threading.Barrier(2)

    def one(i: int) -> int:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                            "data": [i, 0, 0, 0]}]}
        with server.client() as client:
            together.wait()
            answer = client.post("/v2/models/slow/infer", json=body)
        assert answer.status_code == 200, answer.text
        outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
        return int(outputs["pid"][0])

    with httpx.Client(base_url=server.url) as warm:  # both processes connected and warm
        for i in range(4):
            assert warm.post("/v2/models/slow/infer", json={"inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [i, 0, 0, 0]}]},
                timeout=30).status_code == 200
    with ThreadPoolExecutor(2) as pool:
        rounds = [set(pool.map(one, range(2))) for _ in range(ROUNDS)]
    assert all(len(pids) == 2 for pids in rounds), rounds
