"""Triton's model configuration and repository index, written from runner configurations."""

from __future__ import annotations

import orjson
import pytest

from batchserve.api import triton
from batchserve.api.errors import BadRequest
from batchserve.runner.core.config import Batching, RunnerConfig, TensorSpec

ROWS = RunnerConfig(
    name="rows", model="m:f",
    inputs=(TensorSpec("x", "FP32", (-1, 4)), TensorSpec("flag", "BOOL", (-1,))),
    outputs=(TensorSpec("y", "FP64", (-1, 3)),),
    batching=Batching(True, 8, 25.0), workers=3,
)


def config(runner: RunnerConfig) -> dict[str, object]:
    return dict(orjson.loads(triton.model_config(runner)))


def test_rows_batched_first_leave_the_batch_out_of_dims() -> None:
    document = config(ROWS)
    assert document["max_batch_size"] == 8
    assert document["input"] == [
        {"name": "x", "data_type": "TYPE_FP32", "dims": [4]},
        {"name": "flag", "data_type": "TYPE_BOOL", "dims": [1], "reshape": {"shape": []}},
    ]
    assert document["output"] == [{"name": "y", "data_type": "TYPE_FP64", "dims": [3]}]
    assert document["dynamic_batching"] == {"default_queue_policy": {
        "timeout_action": "REJECT", "default_timeout_microseconds": 25000,
        "allow_timeout_override": True}}
    assert document["instance_group"] == [{"name": "rows", "kind": "KIND_CPU", "count": 3}]
    assert document["parameters"]["max_latency_ms"] == {"string_value": "25"}  # type: ignore[index]


@pytest.mark.parametrize("runner", [
    RunnerConfig(name="elsewhere", model="m:f", inputs=(TensorSpec("x", "FP32", (4, -1)),),
                 outputs=(TensorSpec("y", "FP32", (-1, 4)),), batch_dim=(1, 0)),
    RunnerConfig(name="per_request", model="m:f",
                 inputs=(TensorSpec("x", "FP32", (-1, 4)),
                         TensorSpec("mode", "BYTES", (1,), batchable=False)),
                 outputs=(TensorSpec("y", "FP32", (-1, 4)),)),
])
def test_any_other_batching_is_max_batch_size_0_with_the_shapes_a_request_sends(
    runner: RunnerConfig,
) -> None:
    document = config(runner)
    assert document["max_batch_size"] == 0
    assert [item["dims"] for item in document["input"]] == [  # type: ignore[attr-defined]
        list(spec.shape) for spec in runner.inputs]


def test_batching_off_has_no_dynamic_batching_and_says_the_limit_still() -> None:
    runner = RunnerConfig(name="single", model="m:f", inputs=ROWS.inputs, outputs=ROWS.outputs,
                          batching=Batching(False, 8, 40.0))
    document = config(runner)
    assert "dynamic_batching" not in document
    assert document["parameters"]["max_latency_ms"] == {"string_value": "40"}  # type: ignore[index]


def test_the_index_states_each_model_and_why_one_is_unavailable() -> None:
    unready = {"a": None, "b": "no process of its runner is connected"}
    assert orjson.loads(triton.repository_index(unready, b"")) == [
        {"name": "a", "version": "1", "state": "READY"},
        {"name": "b", "version": "1", "state": "UNAVAILABLE",
         "reason": "no process of its runner is connected"}]
    assert orjson.loads(triton.repository_index(unready, b'{"ready": true}')) == [
        {"name": "a", "version": "1", "state": "READY"}]
    with pytest.raises(BadRequest, match=r"^request body must be a JSON object"):
        triton.repository_index(unready, b"[]")
    with pytest.raises(BadRequest, match=r"^request body is not valid JSON"):
        triton.repository_index(unready, b"{")
