"""What grpcio's ways of serving cost: minimal servers shaped like an API worker's gRPC door,
each started fresh and driven at the same rates in one run, CPU per request of its process.

    flock /tmp/batchserve-bench.lock python -m benchmarks.grpc_variants --rates 1600,3200

Every variant serves ``ModelInfer`` as the door does in an API worker: a uvloop event loop
runs (uvicorn's), the call reaches the loop, the loop answers it a callback later (as the
exchange answers when the runner's reply comes) with answer bytes built before. What differs
is grpcio's side (:data:`VARIANTS`): the ``grpc.aio`` server on the loop, or the sync
``grpc.server`` whose pool threads hand each call into the loop and wait; raw bytes both ways
or protobuf's (de)serializers; and server options. The load is ``grpcload.py``, as in
``benchmarks.grpc_cost``, and the table goes between the ``grpc variants`` markers of
``docs/benchmarks.md``. ``python -m benchmarks.grpc_variants serve VARIANT PORT`` runs one.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from batchserve.api.bench.server import free_port
from benchmarks import grpc_cost
from benchmarks.live_table import replace_block

START = "<!-- grpc variants: start -->"
END = "<!-- grpc variants: end -->"
SERVICE = "inference.GRPCInferenceService"
METHOD = f"/{SERVICE}/ModelInfer"

Kind = Literal["aio", "sync"]

PRODUCT: tuple[tuple[str, Any], ...] = (
    ("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", -1))
"""The options `batchserve.api.grpc.server` starts with (64 MiB: the bundled body limit)."""


@dataclass(frozen=True)
class Variant:
    """One way to serve: which server, (de)serializing or not, and its options."""

    kind: Kind
    protobuf: bool = False
    loop: Literal["uvloop", "asyncio"] = "uvloop"
    options: tuple[tuple[str, Any], ...] = ()
    threads: int = 4
    registered: bool = False
    """``add_registered_method_handlers``: the method matched by gRPC's core, not by Python."""
    refuse: Literal["", "abort", "set_code"] = ""
    """Answer every call UNAVAILABLE with trailers, as a refusal under load, and how."""


VARIANTS: dict[str, Variant] = {
    "aio, raw bytes (the door)": Variant("aio"),
    "aio, protobuf (de)serializers": Variant("aio", protobuf=True),
    "aio, registered method handlers": Variant("aio", registered=True),
    "aio, asyncio loop (not uvloop)": Variant("aio", loop="asyncio"),
    "aio, no channelz, no census": Variant("aio", options=(
        ("grpc.enable_channelz", 0), ("grpc.census", 0))),
    "aio, no BDP probe pings": Variant("aio", options=(("grpc.http2.bdp_probe", 0),)),
    "aio, minimal stack (no size limit)": Variant("aio", options=(("grpc.minimal_stack", 1),)),
    "aio, optimization_target throughput": Variant("aio", options=(
        ("grpc.optimization_target", "throughput"),)),
    "aio, max_concurrent_streams 16": Variant("aio", options=(
        ("grpc.max_concurrent_streams", 16),)),
    "aio, every call refused by context.abort": Variant("aio", refuse="abort"),
    "aio, every call refused by context.set_code": Variant("aio", refuse="set_code"),
    "sync grpc.server, 2 threads into the loop": Variant("sync", threads=2),
    "sync grpc.server, 4 threads into the loop": Variant("sync"),
}


# --- the servers ------------------------------------------------------------------------------

def _messages() -> tuple[Any, Any, bytes]:
    """Request and response classes, and the answer's bytes (one row of 16 float32)."""
    from batchserve.api.grpc.messages import message

    request, response = message("ModelInferRequest"), message("ModelInferResponse")
    answer = response(model_name="mlp")
    output = answer.outputs.add()
    output.name, output.datatype = "y", "FP32"
    output.shape.extend([1, 16])
    answer.raw_output_contents.append(bytes(64))
    return request, response, answer.SerializeToString()


REFUSAL: tuple[tuple[str, str], ...] = (("retry-after", "1"), ("batchserve-reason", "queue"))


async def _refuse(how: str, context: Any) -> None:
    import grpc

    if how == "abort":
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the queue is full", REFUSAL)
    context.set_code(grpc.StatusCode.UNAVAILABLE)
    context.set_details("the queue is full")
    context.set_trailing_metadata(REFUSAL)


def _add(server: Any, variant: Variant, call: Callable[..., Any]) -> None:
    """``ModelInfer`` on the server: generic handlers (the door's), or registered ones."""
    import grpc

    request, response, _ = _messages()
    make = grpc.unary_unary_rpc_method_handler
    handler = (make(call, request_deserializer=request.FromString,
                    response_serializer=response.SerializeToString)
               if variant.protobuf else make(call))
    if variant.registered:
        server.add_registered_method_handlers(SERVICE, {"ModelInfer": handler})
    else:
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"ModelInfer": handler}),))


async def _aio(variant: Variant, port: int) -> None:
    """The door's way: ``grpc.aio`` on the running loop, answered a callback later."""
    import grpc

    _, response, answer = _messages()
    reply = response.FromString(answer) if variant.protobuf else answer
    loop = asyncio.get_running_loop()

    async def model_infer(body: Any, context: Any) -> Any:
        done: asyncio.Future[Any] = loop.create_future()
        loop.call_soon(done.set_result, reply)
        answer = await done
        if variant.refuse:
            return await _refuse(variant.refuse, context)
        return answer

    server = grpc.aio.server(options=[*PRODUCT, *variant.options])
    _add(server, variant, model_infer)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _sync(variant: Variant, port: int) -> None:
    """``grpc.server``: a pool thread takes the call, hands it to the loop and waits."""
    import grpc

    _, response, answer = _messages()
    reply = response.FromString(answer) if variant.protobuf else answer
    loop = asyncio.get_running_loop()

    def on_loop(done: concurrent.futures.Future[Any]) -> None:
        loop.call_soon(done.set_result, reply)

    def model_infer(body: Any, context: Any) -> Any:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        loop.call_soon_threadsafe(on_loop, done)
        return done.result()

    pool = concurrent.futures.ThreadPoolExecutor(variant.threads)
    server = grpc.server(pool, options=[*PRODUCT, *variant.options])
    _add(server, variant, model_infer)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    await asyncio.Event().wait()  # until killed


def serve(name: str, port: int) -> None:
    variant = VARIANTS[name]
    main = _aio if variant.kind == "aio" else _sync
    if variant.loop == "uvloop":
        import uvloop

        uvloop.run(main(variant, port))
    else:
        asyncio.run(main(variant, port))


# --- the run ----------------------------------------------------------------------------------

@contextlib.contextmanager
def started(name: str, log: Path) -> Iterator[tuple[int, int]]:
    """One variant in a session of its own; (port, pid), stopped after."""
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.grpc_variants", "serve", name, str(port)]
    with log.open("ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                cwd=grpc_cost.ROOT, start_new_session=True)
    try:
        grpc_cost.wait_port(port, proc)
        yield port, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpc_variants",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1600,3200", help="req/s, Poisson")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each window")
    p.add_argument("--warmup", type=float, default=3.0, help="s at 200 req/s before a variant")
    p.add_argument("--variants", default=",".join(str(i) for i in range(len(VARIANTS))),
                   help="indices into the list of variants, comma-separated")
    p.add_argument("--out", type=Path, default=Path("/tmp/batchserve-grpc-variants"))
    p.add_argument("--doc", default=str(grpc_cost.ROOT / "docs" / "benchmarks.md"),
                   help="markdown file whose grpc variants markers receive the table")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
        return 0
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    session = grpc_cost.Session(args)
    names = list(VARIANTS)
    for index in (int(i) for i in args.variants.split(",") if i.strip()):
        with started(names[index], args.out / f"variant-{index}.log") as (port, pid):
            session.measure(pid, {names[index]: grpc_cost.grpcload(f"127.0.0.1:{port}")})
    text = grpc_cost.markdown(session, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(text)
    if args.doc:
        replace_block(Path(args.doc), text, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
