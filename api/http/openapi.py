"""The OpenAPI description of the HTTP routes, built from the configuration.

Served at `GET /openapi.json` so that clients and contract-testing tools (schemathesis, code
generators) know every route, its answers, and for each model the exact inputs it takes:
the names are enumerated, datatypes fixed and shapes described per the configuration.
"""

from __future__ import annotations

from typing import Any

import orjson

from ...runner.core.config import Config, RunnerConfig, TensorSpec

JSON = "application/json"
ERROR = {"$ref": "#/components/schemas/Error"}


def _answer(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {JSON: {"schema": schema}} if schema is not None else {}
    return {"description": description, "content": body} if body else {"description": description}


def _errors(*codes: int) -> dict[str, Any]:
    words = {400: "the request names what is wrong", 404: "no such model",
             413: "the body is over api.max_body_bytes, or the request has more rows "
                  "than the model runs within its latency limit",
             501: "an extension batchserve does not offer; the error says which",
             503: "retry after Retry-After seconds: refused for the latency limit, "
                  "overloaded, or no runner process reachable"}
    return {str(code): _answer(words[code], ERROR) for code in codes}


def _tensor_input(spec: TensorSpec) -> dict[str, Any]:
    shape = "[" + ", ".join(str(d) for d in spec.shape) + "]"
    meaning = ("-1 marking the batch: any number of rows" if spec.batchable else
               "not batchable: one value per request, whatever its number of rows")
    data: dict[str, Any] = {"type": "array"}
    if spec.datatype == "BYTES":  # strings, flat or nested as the shape
        data["items"] = {"anyOf": [{"type": "string"}, {"type": "array"}]}
        data["description"] = "strings, each sent to the model as its UTF-8 bytes"
    return {
        "type": "object",
        "required": ["name", "datatype", "shape", "data"],
        "properties": {
            "name": {"type": "string", "enum": [spec.name]},
            "datatype": {"type": "string", "enum": [spec.datatype]},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 1},
                      "minItems": len(spec.shape), "maxItems": len(spec.shape),
                      "description": f"{shape}, {meaning}"},
            "data": data,
            "parameters": {"type": "object"},
        },
    }


def _infer(runner: RunnerConfig) -> dict[str, Any]:
    request = {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object",
                           "properties": {"timeout": {"type": "integer", "minimum": 0}}},
            "inputs": {"type": "array", "minItems": 1,
                       "items": {"anyOf": [_tensor_input(spec) for spec in runner.inputs]}},
            "outputs": {"type": "array", "items": {
                "type": "object", "required": ["name"],
                "properties": {"name": {"type": "string",
                                        "enum": [spec.name for spec in runner.outputs]},
                               "parameters": {"type": "object"}}}},
        },
    }
    return {
        "summary": f"Run model {runner.name!r} on a batch of rows (the v2 infer request)",
        "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
        "responses": {"200": _answer("the outputs", {"$ref": "#/components/schemas/Response"}),
                      **_errors(400, 404, 413, 503)},
    }


def _get(summary: str, schema: dict[str, Any] | None, *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary,
                    "responses": {"200": _answer("ok", schema), **_errors(*errors)}}}


_INDEX = {"type": "array", "items": {
    "type": "object", "required": ["name", "version", "state"],
    "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                   "state": {"type": "string", "enum": ["READY", "UNAVAILABLE"]},
                   "reason": {"type": "string"}}}}
_STATS = {"type": "object", "required": ["model_stats"],
          "properties": {"model_stats": {"type": "array", "items": {"type": "object"}}}}


def _post(summary: str, schema: dict[str, Any], body: dict[str, Any], *errors: int
          ) -> dict[str, Any]:
    return {"post": {"summary": summary,
                     "requestBody": {"required": False, "content": {JSON: {"schema": body}}},
                     "responses": {"200": _answer("ok", schema), **_errors(*errors)}}}


def _extensions() -> dict[str, Any]:
    """Triton's extensions that answer 501, each path once (a region's paths alike)."""
    refused: dict[str, Any] = {"responses": _errors(501)}
    paths: dict[str, Any] = {
        "/v2/repository/models/{name}/load": {"post": refused},
        "/v2/repository/models/{name}/unload": {"post": refused},
        "/v2/logging": {"get": refused, "post": refused},
        "/v2/trace/setting": {"get": refused, "post": refused},
    }
    for memory in ("systemsharedmemory", "cudasharedmemory"):
        paths[f"/v2/{memory}/status"] = {"get": refused}
        paths[f"/v2/{memory}/register"] = {"post": refused}
        paths[f"/v2/{memory}/unregister"] = {"post": refused}
    return paths


def _model(name: str, runner: RunnerConfig) -> dict[str, Any]:
    ready = {"type": "object", "properties": {"ready": {"type": "boolean"}}}
    return {
        f"/v2/models/{name}": _get(f"Model {name!r}'s metadata", {"type": "object"}),
        f"/v2/models/{name}/ready": _get(f"Whether {name!r} can serve", ready, 503),
        f"/v2/models/{name}/config": _get(f"Model {name!r}'s configuration, in Triton's "
                                          "shape", {"type": "object"}),
        f"/v2/models/{name}/stats": _get(f"Model {name!r}'s inference statistics", _STATS),
        f"/v2/models/{name}/infer": {"post": _infer(runner)},
    }


def document(config: Config) -> dict[str, Any]:
    """The OpenAPI 3.0 document for a server of `config`."""
    ready = {"type": "object", "properties": {"ready": {"type": "boolean"}}}
    live = {"type": "object", "properties": {"live": {"type": "boolean"}}}
    paths: dict[str, Any] = {
        "/v2/health/live": _get("Whether the API worker runs", live),
        "/v2/health/ready": _get("Whether every runner has a process connected", ready, 503),
        "/v2": _get("Server metadata", {"type": "object"}),
        "/v2/models/stats": _get("Every model's inference statistics", _STATS),
        "/v2/repository/index": _post(
            "Every served model and its state", _INDEX,
            {"type": "object", "properties": {"ready": {"type": "boolean"}}}, 400),
        **_extensions(),
    }
    for name, runner in config.runners.items():
        paths.update(_model(name, runner))
    for name, pipeline in config.pipelines.items():  # a pipeline is a model to clients
        paths.update(_model(name, pipeline.facade))
    return {
        "openapi": "3.0.3",
        "info": {"title": "batchserve", "version": "1",
                 "description": "Open Inference Protocol v2 over adaptive-batching runners"},
        "paths": paths,
        "components": {"schemas": {
            "Error": {"type": "object", "required": ["error"],
                      "properties": {"error": {"type": "string"},
                                     # a 503's: why, and the numbers behind it
                                     "reason": {"type": "string"},
                                     "lag_ms": {"type": "number"},
                                     "refused_share": {"type": "number"},
                                     "inflight": {"type": "integer"},
                                     "predicted_ms": {"type": "number"},
                                     "deadline_ms": {"type": "number"},
                                     "rows_ahead": {"type": "integer"},
                                     "step": {"type": "integer"}}},
            "Response": {"type": "object", "required": ["model_name", "outputs"],
                         "properties": {"model_name": {"type": "string"},
                                        "model_version": {"type": "string"},
                                        "id": {"type": "string"},
                                        "outputs": {"type": "array"}}},
        }},
    }


def encode(config: Config) -> bytes:
    return orjson.dumps(document(config))
