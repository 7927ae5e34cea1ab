"""The protocol's messages, built from `inference.proto`'s descriptors in a pool of their own.

Why a pool of its own: tritonclient.grpc and KServe's SDK each register `inference.*` in
protobuf's default pool, and a process that imports two such sets of stubs fails with
`duplicate symbol 'inference.ServerLiveRequest'`. batchserve's messages share their names and
field numbers (so they are the same on the wire) but live in `POOL`, so a user's process may
import tritonclient.grpc, KServe's SDK or its own stubs beside batchserve, in either order.

Messages are looked up by their name in the protocol: `message("ModelInferRequest")`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from .descriptor import FILE

__all__ = ["PACKAGE", "POOL", "SERVICE", "message"]

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"

POOL = descriptor_pool.DescriptorPool()
POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(FILE))


@cache
def message(name: str) -> Any:
    """The message class `inference.<name>` (nested ones as `Outer.Inner`)."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))
