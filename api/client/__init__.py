"""The Python client for batchserve, or any Open Inference Protocol v2 server over HTTP or gRPC:
its front ends in `client`, their shared core without sockets in `codec`, the ways to the
server in `transports` (gRPC's messages in `grpc_codec`). Needs httpx."""

from .client import (
    AsyncModelClient,
    ChunkingStrategy,
    DeadlineExceeded,
    FuturesModelClient,
    ModelClient,
    ModelMetadata,
    Parameters,
    ServerError,
    ServerUnavailable,
    TensorInfo,
    split_along,
    split_first_dim,
)

__all__ = [
    "AsyncModelClient",
    "ChunkingStrategy",
    "DeadlineExceeded",
    "FuturesModelClient",
    "ModelClient",
    "ModelMetadata",
    "Parameters",
    "ServerError",
    "ServerUnavailable",
    "TensorInfo",
    "split_along",
    "split_first_dim",
]
