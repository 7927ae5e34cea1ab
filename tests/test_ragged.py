"""Ragged and pad inputs without a server: the configuration, the join and the policy's caps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from batchserve.runner.core import ragged
from batchserve.runner.core.config import ConfigError, RunnerConfig, load, parse
from batchserve.runner.dispatcher import synthetic_inputs
from batchserve.runner.policy.adaptive import AdaptivePolicy
from batchserve.runner.policy.base import Request
from batchserve.runner.policy.latency_model import Timing
from batchserve.runner.text_model import VOCAB, PaddedText, RaggedText

RAGGED = """
runners:
  text:
    model: batchserve.runner.text_model:RaggedText
    batching: {max_batch_size: 8, max_batch_elements: 64, max_latency_ms: 100}
    inputs:
      - {name: tokens, datatype: INT64, shape: [-1], ragged: true}
    batch_inputs:
      - {kind: accumulated_element_count, name: offsets, source: tokens}
      - {kind: element_count, name: counts, source: tokens, datatype: INT32}
      - {kind: accumulated_element_count_with_zero, name: bounds, source: tokens}
    outputs:
      - {name: scores, datatype: FP32, shape: [-1, 4]}
"""
PAD = RAGGED.replace("ragged: true", "pad: {value: -7}")


def runner(text: str, tmp_path: Path) -> RunnerConfig:
    path = tmp_path / "configuration.yml"
    path.write_text(text)
    return load(path).runners["text"]


def sequences(*lengths: int) -> list[dict[str, np.ndarray]]:
    starts = np.cumsum((0, *lengths))[:-1]
    return [{"tokens": np.arange(start, start + n, dtype=np.int64)}
            for start, n in zip(starts, lengths, strict=True)]


def test_a_ragged_batch_is_the_concatenation_and_its_batch_inputs(tmp_path: Path) -> None:
    joined = ragged.join(runner(RAGGED, tmp_path), sequences(3, 4, 5))
    np.testing.assert_array_equal(joined["tokens"], np.arange(12))
    assert joined["offsets"].tolist() == [3, 7, 12]
    assert joined["counts"].tolist() == [3, 4, 5] and joined["counts"].dtype == np.int32
    assert joined["bounds"].tolist() == [0, 3, 7, 12] and joined["bounds"].dtype == np.int64


def test_a_padded_batch_is_rows_filled_with_the_pad_value(tmp_path: Path) -> None:
    joined = ragged.join(runner(PAD, tmp_path), sequences(2, 3, 1))
    assert joined["tokens"].tolist() == [[0, 1, -7], [2, 3, 4], [5, -7, -7]]
    assert joined["counts"].tolist() == [2, 3, 1]
    assert joined["offsets"].tolist() == [2, 5, 6]


def test_a_request_costs_the_elements_of_its_longest_input() -> None:
    request = {"a": np.zeros(3), "b": np.zeros(7)}
    assert ragged.elements(request) == 7


@pytest.mark.parametrize("elements", [1, 5, 8, 9, 64, 100])
def test_calibration_batches_hold_the_elements_asked_within_the_row_cap(
    tmp_path: Path, elements: int
) -> None:
    config = runner(RAGGED, tmp_path)
    requests = ragged.synthetic(config, elements)
    assert sum(len(request["tokens"]) for request in requests) == elements
    assert 1 <= len(requests) <= config.batching.max_batch_size
    assert min(len(request["tokens"]) for request in requests) >= 1
    batch = synthetic_inputs(config, elements)
    assert batch["offsets"][-1] == elements and batch["tokens"].dtype == np.int64


BAD = {
    "both layouts": (
        ("ragged: true", "ragged: true, pad: {value: 0}"),
        "runners.text.inputs[0] has both ragged and pad; an input may have one or the other",
    ),
    "not flat": (
        ("shape: [-1], ragged: true", "shape: [-1, 4], ragged: true"),
        "runners.text.inputs[0].shape has value [-1, 4]; it must be [-1] for a ragged input: "
        "one flat sequence a request, its length the dimension that varies",
    ),
    "pad value": (
        ("ragged: true", "pad: {value: 0.5}"),
        "runners.text.inputs[0].pad.value has value 0.5; it must be a finite number that "
        "INT64 can hold",
    ),
    "mixed layouts": (
        ("ragged: true}", "ragged: true}\n      - {name: x, datatype: FP32, shape: [-1, 2]}"),
        "runners.text.inputs[1] ('x') is neither ragged nor pad; since input 'tokens' is "
        "ragged, every input must be ragged",
    ),
    "no element cap": (
        ("max_batch_elements: 64, ", ""),
        "runners.text.batching.max_batch_elements is missing; a runner with ragged inputs "
        "needs it: the most elements one batch may hold",
    ),
    "element cap on rows": (
        ("shape: [-1], ragged: true", "shape: [-1, 2]"),
        "runners.text.batching.max_batch_elements has value 64; it applies only to a runner "
        "whose inputs are ragged or pad (this one batches rows: use max_batch_size)",
    ),
    "unknown kind": (
        ("kind: element_count,", "kind: lengths,"),
        "runners.text.batch_inputs[1].kind has value 'lengths'; it must be one of "
        "element_count, accumulated_element_count, accumulated_element_count_with_zero",
    ),
    "unknown source": (
        ("name: counts, source: tokens", "name: counts, source: words"),
        "runners.text.batch_inputs[1].source has value 'words'; it must be the name of an "
        "input: tokens",
    ),
    "clashing name": (
        ("name: counts,", "name: tokens,"),
        "runners.text.batch_inputs has value ['offsets', 'tokens', 'bounds']; it must be names "
        "distinct from each other and from the inputs",
    ),
    "ragged and not batchable": (
        ("ragged: true}", "ragged: true, batchable: false}"),
        "runners.text.inputs[0] has batchable: false and ragged; an input of variable length "
        "is joined across requests, so it cannot also be given to the model per request",
    ),
    "not batchable beside ragged": (
        ("ragged: true}",
         "ragged: true}\n      - {name: sep, datatype: BYTES, shape: [1], batchable: false}"),
        "runners.text.inputs[1] ('sep') has batchable: false; since input 'tokens' is ragged, "
        "every input is joined across requests and none may be batchable: false",
    ),
    "ragged strings": (
        ("datatype: INT64, shape: [-1], ragged", "datatype: BYTES, shape: [-1], ragged"),
        "runners.text.inputs[0].datatype has value 'BYTES'; it must be a datatype other than "
        "BYTES for a ragged input",
    ),
    "ragged on an output": (
        ("shape: [-1, 4]}", "shape: [-1, 4], ragged: true}"),
        "runners.text.outputs[0].shape has value [-1, 4]; it must be [-1] for a ragged "
        "output: one flat sequence a request",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_variable_length_settings_name_their_key(tmp_path: Path, case: str) -> None:
    change, message = BAD[case]
    assert change[0] in RAGGED
    with pytest.raises(ConfigError) as raised:
        runner(RAGGED.replace(*change), tmp_path)
    assert str(raised.value).startswith(message)


def test_a_ragged_input_needs_a_batch_input_that_finds_its_requests() -> None:
    document = {"runners": {"text": {
        "model": "m:f",
        "batching": {"max_batch_elements": 10},
        "inputs": [{"name": "a", "datatype": "INT64", "shape": [-1], "ragged": True},
                   {"name": "b", "datatype": "INT64", "shape": [-1], "ragged": True}],
        "batch_inputs": [{"kind": "element_count", "name": "n", "source": "a"}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }}}
    with pytest.raises(ConfigError, match=r"^runners\.text\.batch_inputs has no entry with "
                       r"source 'b'; the model of a ragged input needs its element counts"):
        parse(document)
    document["runners"]["text"].pop("batch_inputs")
    with pytest.raises(ConfigError, match=r"^runners\.text\.batch_inputs has value None; it "
                       r"must be a non-empty list of \{kind, name, source\} for ragged inputs"):
        parse(document)


def test_batch_inputs_without_variable_length_inputs_are_refused() -> None:
    document = {"runners": {"m": {
        "model": "m:f",
        "inputs": [{"name": "a", "datatype": "INT64", "shape": [-1]}],
        "batch_inputs": [{"kind": "element_count", "name": "n", "source": "a"}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }}}
    with pytest.raises(ConfigError, match=r"^runners\.m\.batch_inputs is set, but no input is "
                       r"ragged or pad"):
        parse(document)


# --- the policy: a cap in elements, and a bound on requests ---------------------------------


def calibrated(max_elements: int, max_requests: int | None) -> AdaptivePolicy:
    """A policy that has timed batches of 1 ms plus 10 us an element."""
    policy = AdaptivePolicy(max_elements, 0.1, max_requests=max_requests)
    policy.calibrate([Timing(n, 0.001 + 1e-5 * n, 0.001 + 1e-5 * n)
                      for n in policy.calibration_sizes()])
    return policy


def drain(policy: AdaptivePolicy, sizes: list[int]) -> list[tuple[int, ...]]:
    """Offer requests of these sizes at once, then run every batch; each batch's sizes."""
    now = 0.0
    for ident, size in enumerate(sizes):
        assert policy.offer(Request(ident, size, now, now + 10.0), now)
    batches = []
    while True:
        step = policy.poll(now)
        assert not step.expired
        if step.batch is None:
            if step.wake_at is None:
                return batches
            now = step.wake_at
            continue
        batches.append(tuple(request.rows for request in step.batch.requests))
        now += 0.002
        policy.complete(step.batch, now - 0.002, now)


def test_a_batch_holds_at_most_max_requests_requests() -> None:
    batches = drain(calibrated(1000, max_requests=4), [5] * 20)
    assert sum(len(batch) for batch in batches) == 20
    assert max(len(batch) for batch in batches) == 4


def test_a_batch_holds_at_most_max_elements_elements() -> None:
    sizes = [30, 7, 50, 1, 64, 12, 33, 2, 9, 40] * 3
    batches = drain(calibrated(64, max_requests=64), sizes)
    assert [size for batch in batches for size in batch] == sizes  # in order, none lost
    assert max(sum(batch) for batch in batches) <= 64
    assert max(len(batch) for batch in batches) > 1


def test_without_max_requests_a_batch_is_bounded_by_size_only() -> None:
    batches = drain(calibrated(1000, max_requests=None), [1] * 40)
    assert max(len(batch) for batch in batches) > 4


def test_the_text_model_takes_any_id_modulo_its_vocabulary() -> None:
    model, padded = RaggedText(), PaddedText()
    with torch.inference_mode():
        wide = model(torch.tensor([VOCAB + 1, -1, 5]), torch.tensor([2, 3]))
        narrow = model(torch.tensor([1, VOCAB - 1, 5]), torch.tensor([2, 3]))
        rows = padded(torch.tensor([[VOCAB + 1, -1], [5, 0]]), torch.tensor([2, 1]))
    assert torch.equal(wide, narrow) and torch.equal(rows, narrow)
