"""The error hierarchy: statuses, messages, and the one handler that renders them."""

from __future__ import annotations

import orjson
import pytest

from batchserve.api.errors import (
    BadRequest,
    BatchserveError,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RunnerUnavailable,
    SloRefused,
    Stopping,
    Unavailable,
    error_response,
)


@pytest.mark.parametrize(
    ("error", "status", "message"),
    [
        (BatchserveError("broken"), 500, "broken"),
        (BadRequest("input 'x' is missing"), 400, "input 'x' is missing"),
        (
            ModelNotFound("nope", ["b", "a"]),
            404,
            "model 'nope' is not served here; known models: a, b",
        ),
        (ModelNotFound("nope"), 404, "model 'nope' is not served here"),
        (
            PayloadTooLarge(100, 150),
            413,
            "request body of 150 bytes exceeds the limit of 100 bytes",
        ),
        (PayloadTooLarge(100), 413, "request body exceeds the limit of 100 bytes"),
        (Unavailable("busy"), 503, "busy"),
        (
            RunnerUnavailable("mlp"),
            503,
            "runner 'mlp' is not available (its process is stopping or restarting); retry shortly",
        ),
        (
            SloRefused("mlp"),
            503,
            "runner 'mlp' refused the request: it cannot be answered within the runner's "
            "latency limit; retry later",
        ),
    ],
)
def test_status_and_message(error: BatchserveError, status: int, message: str) -> None:
    assert error.status == status
    assert str(error) == message
    got_status, body, headers = error_response(error)
    assert got_status == status
    expected = {"error": message}
    if isinstance(error, Unavailable):
        expected["reason"] = error.reason
    assert orjson.loads(body) == expected
    assert headers["Content-Type"] == "application/json"
    assert ("Retry-After" in headers) is (status == 503)


@pytest.mark.parametrize(
    ("error", "reason", "details"),
    [
        (Overloaded("this API worker runs 212 ms behind", details={"lag_ms": 212.0}), "front",
         {"lag_ms": 212.0}),
        (SloRefused("mlp"), "queue", {}),
        (SloRefused("mlp", 1.0, {"predicted_ms": 142.0, "deadline_ms": 100.0, "rows_ahead": 180}),
         "queue", {"predicted_ms": 142.0, "deadline_ms": 100.0, "rows_ahead": 180}),
        (Stopping(), "draining", {}),
    ],
)
def test_a_503_body_names_its_reason_and_the_numbers_behind_it(
    error: Unavailable, reason: str, details: dict[str, float]
) -> None:
    _, body, _ = error_response(error)
    assert orjson.loads(body) == {"error": error.message, "reason": reason, **details}


@pytest.mark.parametrize(("retry_after", "header"), [(1.0, "1"), (0.2, "1"), (2.5, "3"), (0, "0")])
def test_retry_after_is_whole_seconds_rounded_up(retry_after: float, header: str) -> None:
    _, _, headers = error_response(SloRefused("mlp", retry_after))
    assert headers["Retry-After"] == header


def test_unavailable_subclasses_are_caught_as_unavailable() -> None:
    for error in (RunnerUnavailable("a"), SloRefused("a")):
        assert isinstance(error, Unavailable)
        assert isinstance(error, BatchserveError)


def test_foreign_exceptions_become_a_bare_500() -> None:
    status, body, headers = error_response(KeyError("/secret/path"))
    assert status == 500
    assert orjson.loads(body) == {"error": "internal server error"}
    assert "Retry-After" not in headers
