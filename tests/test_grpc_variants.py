"""`python -m benchmarks.grpc_variants`: each way of serving answers `ModelInfer` as the door
does, with the same answer bytes, whether grpcio's server is the aio or the sync one."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from batchserve.api.grpc.messages import message
from benchmarks import grpc_variants
from benchmarks.grpc_variants import VARIANTS


@pytest.mark.parametrize("name", [
    "aio, raw bytes (the door)", "aio, protobuf (de)serializers", "aio, registered method handlers",
    "sync grpc.server, 2 threads into the loop",
])
def test_a_variant_answers_model_infer(name: str, tmp_path: Path) -> None:
    request = message("ModelInferRequest")(model_name="mlp").SerializeToString()
    with grpc_variants.started(name, tmp_path / "variant.log") as (port, _), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answer = channel.unary_unary(grpc_variants.METHOD)(request, timeout=30)
    found = message("ModelInferResponse").FromString(answer)
    assert (found.model_name, list(found.outputs[0].shape)) == ("mlp", [1, 16])
    assert found.raw_output_contents == [bytes(64)]


def test_every_variant_is_one_of_the_two_servers_on_one_of_the_two_loops() -> None:
    for variant in VARIANTS.values():
        assert variant.kind in ("aio", "sync") and variant.loop in ("uvloop", "asyncio")
        assert all(key.startswith("grpc.") for key, _ in variant.options)
