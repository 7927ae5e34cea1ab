"""The gRPC door without a server: the status code of every error, and reading requests."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from batchserve.api import errors
from batchserve.api.grpc.codec import read_request
from batchserve.api.grpc.door import refusal_of, status_of, trailers_of


@pytest.mark.parametrize(("error", "code"), [
    (errors.BadRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ModelNotFound("m"), grpc.StatusCode.NOT_FOUND),
    (errors.TooManyRows("x"), grpc.StatusCode.OUT_OF_RANGE),
    (errors.PayloadTooLarge(10), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.NotSupported("x"), grpc.StatusCode.UNIMPLEMENTED),
    (errors.ModelTimeout("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable("x", reason="expired"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable("x", reason="late"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.SloRefused("m"), grpc.StatusCode.UNAVAILABLE),
    (errors.Overloaded("behind"), grpc.StatusCode.UNAVAILABLE),
    (errors.Stopping(), grpc.StatusCode.UNAVAILABLE),
    (errors.RunnerUnavailable("m"), grpc.StatusCode.UNAVAILABLE),
    (errors.BatchserveError("x"), grpc.StatusCode.INTERNAL),
    (KeyError("secret"), grpc.StatusCode.INTERNAL),
])
def test_every_error_has_its_code(error: BaseException, code: grpc.StatusCode) -> None:
    assert status_of(error) == code


def test_a_refusal_carries_its_reason_and_delay_and_a_foreign_error_says_nothing() -> None:
    refused = errors.BacklogRefused("mlp", 2.3, {"predicted_ms": 142.3, "rows_ahead": 180})
    assert trailers_of(refused) == {"retry-after": "3", "batchserve-reason": "backlog",
                                    "batchserve-predicted-ms": "142.3",
                                    "batchserve-rows-ahead": "180"}
    assert refusal_of(KeyError("secret")) == (500, b"internal server error",
                                              {"grpc-status": "INTERNAL"})
    assert refusal_of(errors.BadRequest("no"))[:2] == (400, b"no")


def test_a_request_is_parsed_once_and_its_model_read_off_it() -> None:
    request = service_pb2.ModelInferRequest(model_name="mlp", model_version="1", id="7")
    data = np.ones(256, np.float32).tobytes()
    request.raw_input_contents.append(data)
    request.parameters["timeout"].int64_param = 5
    parsed = read_request(request.SerializeToString())
    assert (parsed.model_name, parsed.model_version, parsed.id) == ("mlp", "1", "7")
    assert parsed.raw_input_contents[0] == data
    empty = read_request(service_pb2.ModelInferRequest().SerializeToString())
    assert (empty.model_name, empty.model_version, empty.id) == ("", "", "")
    with pytest.raises(errors.BadRequest, match="not a valid ModelInferRequest"):
        read_request(b"\x0a\x05ml")  # a field that runs past the end
    with pytest.raises(errors.BadRequest, match="not a valid ModelInferRequest"):
        read_request(b"\x0a\x02\xff\xfe")  # a model name that is not UTF-8
