"""Triton's extensions of the v2 protocol that `tritonclient.http` and PyTriton call: a model's
configuration, the repository index, and the answers for extensions batchserve does not offer.

Why a model configuration at all: Triton clients read it before they infer (PyTriton's
`ModelClient` takes the inputs' order, datatypes and whether the model batches from it), so a
server without it fails them at their first call. The document is Triton's JSON shape, written
from the runner's configuration, and says only what the runner does:

- `max_batch_size` is the runner's when requests batch along a leading dimension that every
  input and output has (Triton's convention, under which `dims` leave the batch out); else 0,
  with `dims` the whole shape as a request sends it (a ragged sequence, an input that is not
  batchable, a batch dimension elsewhere). A tensor with no dimension besides the batch is
  `dims: [1]` reshaped to `[]`, as Triton writes it.
- `dynamic_batching.default_queue_policy` holds the latency limit: a request that cannot be
  answered within `max_latency_ms` is rejected (`REJECT`), and its own `timeout` may shorten it.
- `parameters` name what Triton's fields cannot: the limit itself, the batch dimensions, the
  inputs that are one value per request, and the cap in elements of ragged or pad inputs.

A pipeline is described as Triton describes an ensemble (`platform: "ensemble"`, its steps in
`ensemble_scheduling.step` with each step's `input_map` and `output_map`), so a Triton client
calls it as it would an ensemble; its inputs are what the request brings, its outputs the
answer's, and its queue policy the pipeline's one limit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Final

import orjson

from ..runner.core.config import RunnerConfig, TensorSpec
from ..runner.core.pipeline import PipelineConfig
from .errors import BadRequest, NotSupported

__all__ = ["model_config", "repository_index", "unsupported"]

_TYPES: Final = {
    "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "FP16": "TYPE_FP16",
    "FP32": "TYPE_FP32", "FP64": "TYPE_FP64", "BYTES": "TYPE_STRING",
}
_BATCH_INPUT_KINDS: Final = {
    "element_count": "BATCH_ELEMENT_COUNT",
    "accumulated_element_count": "BATCH_ACCUMULATED_ELEMENT_COUNT",
    "accumulated_element_count_with_zero": "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
}


def batches_leading(runner: RunnerConfig) -> bool:
    """Whether requests batch along a leading dimension every tensor has: Triton's batching
    (not so for a ragged output, one flat sequence a request)."""
    return (runner.layout == "rows" and runner.batch_dim == (0, 0)
            and all(spec.batchable for spec in runner.inputs)
            and all(spec.layout == "rows" for spec in runner.outputs))


def _tensor(spec: TensorSpec, leading: bool) -> dict[str, Any]:
    dims = list(spec.shape[1:] if leading else spec.shape)
    tensor: dict[str, Any] = {"name": spec.name, "data_type": _TYPES[spec.datatype],
                              "dims": dims or [1]}
    if not dims:
        tensor["reshape"] = {"shape": []}
    if spec.layout == "ragged":
        tensor["allow_ragged_batch"] = True
    return tensor


def _parameters(runner: RunnerConfig) -> dict[str, dict[str, str]]:
    values = {"max_latency_ms": f"{runner.batching.max_latency_ms:g}",
              "input_batch_dim": str(runner.batch_dim[0]),
              "output_batch_dim": str(runner.batch_dim[1])}
    if runner.unbatched:
        values["unbatched_inputs"] = ",".join(sorted(runner.unbatched))
    if runner.layout != "rows":
        values["variable_length"] = runner.layout
        values["max_batch_elements"] = str(runner.max_cost)
        values["max_batch_requests"] = str(runner.batching.max_batch_size)
    return {key: {"string_value": value} for key, value in values.items()}


def config_document(runner: RunnerConfig, leading: bool | None = None) -> dict[str, Any]:
    """The runner as a Triton model configuration (see the module's docstring); `leading`
    False describes whole shapes, without Triton's batch dimension."""
    leading = batches_leading(runner) if leading is None else leading
    document: dict[str, Any] = {
        "name": runner.name,
        "platform": "batchserve",
        "backend": "batchserve",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": runner.batching.max_batch_size if leading else 0,
        "input": [_tensor(spec, leading) for spec in runner.inputs],
        "output": [_tensor(replace(spec, layout="rows"), leading) for spec in runner.outputs],
    }
    if runner.batch_inputs:
        document["batch_input"] = [
            {"kind": _BATCH_INPUT_KINDS[item.kind], "target_name": [item.name],
             "data_type": _TYPES[item.datatype], "source_input": [item.source]}
            for item in runner.batch_inputs
        ]
    if runner.batching.enabled:
        document["dynamic_batching"] = {"default_queue_policy": {
            "timeout_action": "REJECT",
            "default_timeout_microseconds": round(runner.batching.max_latency_ms * 1000),
            "allow_timeout_override": True,
        }}
    if not runner.addresses:  # processes on other hosts are not counted here
        document["instance_group"] = [
            {"name": runner.name, "kind": "KIND_CPU", "count": runner.workers}]
    document["parameters"] = _parameters(runner)
    return document


def ensemble_document(pipeline: PipelineConfig) -> dict[str, Any]:
    """The pipeline as a Triton ensemble: its facade's tensors, its steps in order. Its
    shapes are whole (`max_batch_size` 0): a step may change what a row is (a tokenizer's
    strings become one sequence), so the chain promises no batch dimension."""
    document = config_document(pipeline.facade, leading=False)
    for key in ("backend", "dynamic_batching", "instance_group"):
        document.pop(key, None)
    document["platform"] = "ensemble"
    document["ensemble_scheduling"] = {"step": [
        {"model_name": step.runner, "model_version": -1,
         "input_map": dict(step.inputs), "output_map": dict(step.outputs)}
        for step in pipeline.steps]}
    return document


def model_config(runner: RunnerConfig, pipeline: PipelineConfig | None = None) -> bytes:
    """`GET /v2/models/{name}/config`: a runner's, or a pipeline's as an ensemble."""
    if pipeline is not None:
        return orjson.dumps(ensemble_document(pipeline))
    return orjson.dumps(config_document(runner))


def _ready_only(body: bytes) -> bool:
    """The index request's `ready` flag: only models ready to serve when true."""
    if not body.strip():
        return False
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise BadRequest("request body must be a JSON object {ready?: boolean}")
    ready = document.get("ready", False)
    if not isinstance(ready, bool):
        raise BadRequest(f"ready has value {orjson.dumps(ready).decode()}; expected true or "
                         "false")
    return ready


def repository_index(unready: dict[str, str | None], body: bytes) -> bytes:
    """`POST /v2/repository/index`: every served model, `READY` when `unready` gives no reason
    for it, else `UNAVAILABLE` with that reason; `{"ready": true}` asks for the ready ones."""
    ready_only = _ready_only(body)
    index = []
    for name, reason in unready.items():
        if reason is None:
            index.append({"name": name, "version": "1", "state": "READY"})
        elif not ready_only:
            index.append({"name": name, "version": "1", "state": "UNAVAILABLE",
                          "reason": reason})
    return orjson.dumps(index)


_UNSUPPORTED: Final = {
    "load": "batchserve does not load or unload models while it runs: its models are the "
            "runners of its configuration file, started with the server",
    "systemsharedmemory": "batchserve does not support system shared memory: send tensors "
                          "in the body (JSON or binary)",
    "cudasharedmemory": "batchserve does not support CUDA shared memory: send tensors in the "
                        "body (JSON or binary)",
    "logging": "batchserve does not expose its log settings over HTTP",
    "trace": "batchserve does not support request tracing; see GET /metrics",
}


def unsupported(extension: str) -> NotSupported:
    """The 501 for one of the extensions batchserve does not offer."""
    return NotSupported(_UNSUPPORTED[extension])
