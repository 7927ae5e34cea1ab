"""One valid v2 infer request for any served model, made from its metadata.

Why from the metadata: `batchserve bench --model NAME` must load any model by its name alone,
whatever its inputs: rows of numbers, strings (`BYTES`), ragged sequences, values that are one
per request, request parameters a runner groups by. `GET /v2/models/{name}` says all of it:

- a batchable input gets `rows` rows at its batch dimension (`input_batch_dim`), and
  `elements` wherever else its shape is -1; a ragged or pad input (`variable_length`) one
  sequence of `elements`;
- an input with `batchable: false` gets one empty value (zeros, or `b""`), the very value a
  runner times its model with at start, which every model must take;
- numbers are drawn from a seeded generator (integers from 0 to 99, so token ids stay small),
  strings are a few lowercase words;
- `group_by` parameters take the value the runner was timed with, unless `parameters` gives
  one (a runner timed with the model's default names none: then it must be given).

`shapes` overrides an input's shape, as the command's `--shape NAME=D1,D2` does.
"""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import numpy as np
import orjson

from ..client.codec import ModelMetadata, ServerError
from ..client.grpc_codec import encode_infer
from .probe import Unreachable

__all__ = ["RequestError", "grpc_request", "metadata", "request_body", "request_tensors"]

_WORDS = ("alpha", "batch", "core", "delta", "echo", "frame", "grid", "host", "index", "join")
_DTYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}


class RequestError(ValueError):
    """No valid request can be made: the model is unknown, or a value must be given."""


def metadata(base_url: str, model: str, timeout: float = 10.0) -> dict[str, Any]:
    """The model's v2 metadata; the server's own error when it has none to give."""
    url = f"{base_url}/v2/models/{quote(model, safe='')}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            document: dict[str, Any] = json.loads(answer.read())
            return document
    except urllib.error.HTTPError as exc:
        text = exc.read().decode("utf-8", "replace").strip()
        raise RequestError(f"GET {url} answered {exc.code}: {text}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"cannot reach {base_url}: {reason}") from None


def _shape(tensor: Mapping[str, Any], params: Mapping[str, Any], rows: int,
           elements: int) -> list[int]:
    shape = list(tensor["shape"])
    if "variable_length" in params:
        return [elements]
    if tensor.get("parameters", {}).get("batchable") is False:
        return [1 if dim == -1 else dim for dim in shape]
    batch_dim = int(params.get("input_batch_dim", 0))
    return [rows if i == batch_dim else (elements if dim == -1 else dim)
            for i, dim in enumerate(shape)]


def _data(datatype: str, shape: list[int], empty: bool, rng: np.random.Generator
          ) -> np.ndarray:
    size = int(np.prod(shape))
    if datatype == "BYTES":
        if empty:
            return np.array([b""] * size, dtype=object).reshape(shape)
        words = [" ".join(rng.choice(_WORDS, int(rng.integers(1, 5)))).encode()
                 for _ in range(size)]
        return np.array(words, dtype=object).reshape(shape)
    if datatype not in _DTYPES:
        raise RequestError(f"datatype {datatype!r} is not a v2 datatype this bench can make")
    dtype = _DTYPES[datatype]
    if empty:
        return np.zeros(shape, dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 100, shape).astype(dtype)


def _raw(array: np.ndarray) -> bytes:
    """Tensor data as the binary tensor extension lays them out."""
    if array.dtype != object:
        return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
    return b"".join(struct.pack("<I", len(item)) + item for item in array.ravel())


def _json_data(array: np.ndarray) -> list[Any]:
    if array.dtype == object:
        return [item.decode() for item in array.ravel()]
    return list(array.ravel().tolist())


def _request_parameters(params: Mapping[str, Any], given: Mapping[str, Any], model: str
                        ) -> dict[str, Any]:
    values = dict(params.get("group_by") or {})
    values.update(given)
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise RequestError(f"model {model!r} batches requests by parameter {missing[0]!r}, "
                           f"with no value of its own: give --parameter {missing[0]}=VALUE")
    return values


def request_tensors(
    described: Mapping[str, Any], *, rows: int = 1, elements: int = 16, seed: int = 0,
    parameters: Mapping[str, Any] | None = None, shapes: Mapping[str, list[int]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The inputs by name and the request parameters for the model `described` by its
    metadata, whichever protocol carries them."""
    params = described.get("parameters") or {}
    shapes = shapes or {}
    unknown = sorted(set(shapes) - {tensor["name"] for tensor in described["inputs"]})
    if unknown:
        raise RequestError(f"--shape names {unknown[0]!r}, which is not an input of model "
                           f"{described['name']!r}")
    rng = np.random.default_rng(seed)
    arrays = {}
    for tensor in described["inputs"]:
        shape = shapes.get(tensor["name"]) or _shape(tensor, params, rows, elements)
        empty = tensor.get("parameters", {}).get("batchable") is False
        arrays[tensor["name"]] = _data(tensor["datatype"], shape, empty, rng)
    return arrays, _request_parameters(params, parameters or {}, described["name"])


def request_body(
    described: Mapping[str, Any], *, rows: int = 1, elements: int = 16, binary: bool = False,
    seed: int = 0, parameters: Mapping[str, Any] | None = None,
    shapes: Mapping[str, list[int]] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A v2 infer request body and its headers for the model `described` by its metadata."""
    arrays, values = request_tensors(described, rows=rows, elements=elements, seed=seed,
                                     parameters=parameters, shapes=shapes)
    datatypes = {tensor["name"]: tensor["datatype"] for tensor in described["inputs"]}
    tensors, blobs = [], []
    for name, array in arrays.items():
        item: dict[str, Any] = {"name": name, "datatype": datatypes[name],
                                "shape": list(array.shape)}
        if binary:
            blobs.append(_raw(array))
            item["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            item["data"] = _json_data(array)
        tensors.append(item)
    request: dict[str, Any] = {"inputs": tensors}
    if binary:
        values["binary_data_output"] = True
    if values:
        request["parameters"] = values
    header = orjson.dumps(request)
    if not binary:
        return header, {"Content-Type": "application/json"}
    headers = {"Content-Type": "application/octet-stream",
               "Inference-Header-Content-Length": str(len(header))}
    return header + b"".join(blobs), headers


def grpc_request(
    described: Mapping[str, Any], *, rows: int = 1, elements: int = 16, seed: int = 0,
    parameters: Mapping[str, Any] | None = None, shapes: Mapping[str, list[int]] | None = None,
) -> bytes:
    """The same request as a serialized `ModelInferRequest`, its tensors as raw contents (as
    tritonclient.grpc sends them); its outputs come back raw."""
    arrays, values = request_tensors(described, rows=rows, elements=elements, seed=seed,
                                     parameters=parameters, shapes=shapes)
    try:
        return encode_infer(described["name"], arrays, ModelMetadata.parse(described), True,
                            values)
    except (ServerError, TypeError) as exc:  # metadata not v2's; a parameter gRPC cannot carry
        raise RequestError(str(exc)) from None
