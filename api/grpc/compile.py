"""Compile `inference.proto` into `descriptor.py`: `python -m batchserve.api.grpc.compile`.

The descriptors are checked in, as the serialized `FileDescriptorProto`, so installing
batchserve needs no compiler; a test compiles the `.proto` again and requires the same
descriptors. The compiler, `grpcio-tools`, is a test dependency and imported only here.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import descriptor_pb2

HERE = Path(__file__).resolve().parent
PROTO = HERE / "inference.proto"
OUTPUT = HERE / "descriptor.py"

_HEADER = '''# ruff: noqa: E501
"""The serialized descriptors of `inference.proto`, written by
`python -m batchserve.api.grpc.compile`; do not edit."""

FILE = (
'''


def compile_proto(proto: Path = PROTO) -> descriptor_pb2.FileDescriptorProto:
    """`proto` compiled by protoc (from grpcio-tools), without source locations."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "set.pb"
        status = protoc.main(["protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}",
                              proto.name])
        if status != 0:
            raise RuntimeError(f"protoc failed on {proto} with status {status}")
        found = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (file,) = found.file
    return file


def render(file: descriptor_pb2.FileDescriptorProto) -> str:
    """descriptor.py's text: the serialized descriptor as a bytes literal, 96 bytes a line."""
    data = file.SerializeToString(deterministic=True)
    lines = [f"    {data[start:start + 96]!r}\n" for start in range(0, len(data), 96)]
    return _HEADER + "".join(lines) + ")\n"


def main(argv: Sequence[str] | None = None) -> int:
    OUTPUT.write_text(render(compile_proto()))
    print(f"wrote {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
