"""batchserve's gRPC messages: compiled from inference.proto as checked in, the same on the wire
as tritonclient.grpc's, and never in the way of a user who imports tritonclient.grpc too."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from google.protobuf import descriptor
from tritonclient.grpc import service_pb2

from batchserve.api.grpc import compile as compiler
from batchserve.api.grpc.messages import POOL, SERVICE, message


def test_the_checked_in_descriptors_are_the_proto_compiled_again() -> None:
    assert compiler.OUTPUT.read_text() == compiler.render(compiler.compile_proto())


@pytest.mark.parametrize("order", [
    ["batchserve.api.grpc.messages", "tritonclient.grpc", "tritonclient.grpc.aio"],
    ["tritonclient.grpc", "tritonclient.grpc.aio", "batchserve.api.grpc.server"],
])
def test_importing_beside_tritonclient_grpc_works_in_either_order(order: list[str]) -> None:
    code = "import importlib\n" + "".join(f"importlib.import_module({name!r})\n"
                                           for name in order)
    code += ("from batchserve.api.grpc.messages import message\n"
             "from tritonclient.grpc import service_pb2\n"
             "ours = message('ServerLiveResponse')(live=True).SerializeToString()\n"
             "assert service_pb2.ServerLiveResponse.FromString(ours).live\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _fields(kind: descriptor.Descriptor) -> Iterator[tuple[str, int, int, bool, str]]:
    for field in kind.fields:
        target = field.message_type or field.enum_type
        yield (field.name, field.number, field.type, field.is_repeated,
               target.full_name if target else "")


def _messages(kind: descriptor.Descriptor) -> Iterator[descriptor.Descriptor]:
    yield kind
    for nested in kind.nested_types:
        yield from _messages(nested)


def test_every_message_matches_tritonclients_field_by_field() -> None:
    """Same names and numbers: each of our fields is tritonclient's, so stubs interoperate
    (fields of Triton's model configuration batchserve never fills are left out)."""
    theirs = service_pb2.DESCRIPTOR.pool
    ours = POOL.FindFileByName("inference.proto")
    compared = 0
    for top in ours.message_types_by_name.values():
        for kind in _messages(top):
            other = theirs.FindMessageTypeByName(kind.full_name)
            assert set(_fields(kind)) <= set(_fields(other)), kind.full_name
            compared += 1
    assert compared > 60


def test_every_rpc_matches_tritonclients() -> None:
    ours = POOL.FindServiceByName(SERVICE)
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]

    def rpcs(service: descriptor.ServiceDescriptor) -> set[tuple[str, str, str, bool, bool]]:
        return {(m.name, m.input_type.full_name, m.output_type.full_name,
                 m.client_streaming, m.server_streaming) for m in service.methods}

    assert rpcs(ours) == rpcs(theirs)


def test_messages_are_the_same_bytes_both_ways() -> None:
    sent = service_pb2.ModelInferRequest(model_name="mlp", id="7", raw_input_contents=[b"ab"])
    sent.parameters["timeout"].int64_param = 5
    ours = message("ModelInferRequest").FromString(sent.SerializeToString())
    assert (ours.model_name, ours.id, ours.parameters["timeout"].int64_param) == ("mlp", "7", 5)
    assert service_pb2.ModelInferRequest.FromString(ours.SerializeToString()) == sent
