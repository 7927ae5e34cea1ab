"""The server honours the OpenAPI description it publishes, for any request it allows.

schemathesis generates requests from `GET /openapi.json` (every route, every model's inputs)
and checks each answer: never a 500, a status the description lists, a body of the declared
shape. A 503 is an answer the description allows (refused for the limit, overloaded).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import ROOT, Server, start_server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = start_server(ROOT / "configuration.yml", "--api-workers", "1")
    yield running
    running.stop()


def no_server_error(ctx: object, response: schemathesis.Response, case: object) -> None:
    assert response.status_code != 500, response.text


CHECKS = [no_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def test_every_route_answers_as_described(server: Server) -> None:
    described = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in described.get_all_operations()]
    # 5 server routes, 12 operations of extensions answered 501, 5 per bundled model (5
    # runners and a pipeline).
    assert len(operations) == 47

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def any_case(data: st.DataObject) -> None:
        operation = data.draw(st.sampled_from(operations))
        case = data.draw(operation.as_strategy())
        case.call_and_validate(checks=CHECKS,
                               excluded_checks=[schemathesis.checks.not_a_server_error])

    any_case()
