"""Big request bodies in one API worker, in-process: a large JSON body is decoded off the
event loop, a body whose decoding alone takes longer than the limit is refused 413, and an
image's bytes are not copied on their way from the request body to the model."""

from __future__ import annotations

import asyncio
import re
import threading
import tracemalloc
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
import yaml

from batchserve.api import protocol
from batchserve.api.http.app import create_app
from batchserve.api.service import OFF_LOOP_BYTES
from batchserve.runner import batching
from batchserve.runner.core import wire
from batchserve.runner.core.config import RunnerConfig, parse
from batchserve.runner.models import Model

IMAGES = """
runners:
  resnet:
    model: batchserve.runner.vision:ResNet
    batching: {{max_latency_ms: {limit_ms}}}
    inputs: [{{name: images, datatype: FP32, shape: [-1, 3, 224, 224]}}]
    outputs: [{{name: scores, datatype: FP32, shape: [-1, 1000]}}]
"""
SHAPE = [1, 3, 224, 224]


def image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(SHAPE, dtype=np.float32)


def json_body(array: np.ndarray) -> bytes:
    return orjson.dumps({"inputs": [{"name": "images", "datatype": "FP32",
                                     "shape": list(array.shape), "data": array.ravel().tolist()}]})


def binary_body(array: np.ndarray) -> tuple[bytes, dict[str, str]]:
    header = orjson.dumps({"inputs": [{"name": "images", "datatype": "FP32",
                                       "shape": list(array.shape),
                                       "parameters": {"binary_data_size": array.nbytes}}]})
    return header + array.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def app_for(limit_ms: float) -> Any:
    return create_app(parse(yaml.safe_load(IMAGES.format(limit_ms=limit_ms))), {})


async def post(app: Any, content: bytes, headers: dict[str, str] | None = None
               ) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/v2/models/resnet/infer", content=content, headers=headers)


def test_a_small_request_is_answered_while_a_large_json_body_is_still_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The large body's decoding is held until the small request has been answered: on the
    event loop it would hold the loop, and the small one could never be answered first."""
    big = json_body(image())
    assert len(big) >= OFF_LOOP_BYTES  # one image is some 3 MB of JSON
    started, release = threading.Event(), threading.Event()
    decode = protocol.decode_infer

    def held(body: bytes, header_length: int | None, runner: RunnerConfig
             ) -> protocol.InferRequest:
        if len(body) >= OFF_LOOP_BYTES:
            started.set()
            assert release.wait(30), "the small request was not answered meanwhile"
        return decode(body, header_length, runner)

    monkeypatch.setattr(protocol, "decode_infer", held)
    app = app_for(limit_ms=60_000)
    order: list[str] = []

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async def send(name: str, content: bytes, headers: dict[str, str] | None = None
                       ) -> httpx.Response:
            answer = await post(app, content, headers)
            order.append(name)
            return answer

        loop = asyncio.get_running_loop()
        large = asyncio.create_task(send("large", big))
        assert await loop.run_in_executor(None, started.wait, 30)
        first = await send("small", *binary_body(image(1)))
        release.set()
        return first, await large

    first, second = asyncio.run(run())
    assert order == ["small", "large"]
    # No runner process here: both went all the way to picking one, decoded and admitted.
    for answer in (first, second):
        assert answer.json()["reason"] == "unreachable", answer.text


DECODE = (r"1 rows took ([\d.]+) ms of CPU to decode for runner 'resnet', over its "
          r"max_latency_ms of {limit} before its model runs; ")


def test_a_json_image_whose_decoding_alone_exceeds_the_limit_is_413() -> None:
    """Some 3 MB of JSON take milliseconds to decode, over a limit of 1 ms: refused 413 after
    decoding, then on arrival by the rate learned, without decoding again."""
    app = app_for(limit_ms=1)
    body = json_body(image())

    async def run() -> list[httpx.Response]:
        return [await post(app, body) for _ in range(2)]

    decoded, again = asyncio.run(run())
    assert decoded.status_code == again.status_code == 413
    assert "retry-after" not in decoded.headers
    match = re.match(DECODE.format(limit=1), decoded.json()["error"])
    assert match is not None and float(match[1]) > 1.0, decoded.json()
    assert decoded.json()["error"].endswith(
        "or the tensors as binary data (the binary tensor extension)")
    assert again.json()["error"].startswith(f"a JSON body of {len(body)} bytes takes at least")


def test_a_binary_image_is_judged_on_its_decoding_too() -> None:
    """Binary tensors decode in microseconds, but what they took counts all the same: over a
    limit of a thousandth of a millisecond the image is refused 413, not sent."""
    app = app_for(limit_ms=0.001)
    content, headers = binary_body(image())
    answer = asyncio.run(post(app, content, headers))
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert re.match(DECODE.format(limit=0.001), error), error
    assert "binary tensor extension" not in error  # it is binary already


def allocated_while(work: Any) -> tuple[Any, int]:
    """What `work()` returns and the most memory it held at once beyond what it started with
    (numpy's buffers included: they are traced)."""
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        result = work()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak - start


def received(chunks: wire.Chunks) -> bytearray:
    """The frame body a runner process reads from `chunks` as its socket delivers them: one
    copy, from the socket into the body (the kernel's, in a real read)."""
    reader = wire.FrameReader()
    bodies: list[bytearray] = []
    for chunk in chunks:
        bodies += reader.feed(bytes(chunk))
    (body,) = bodies
    return body


class Capture(torch.nn.Module):
    """A model that keeps the tensor it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.given: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.given.append(images)
        return torch.zeros(images.shape[0], 1000)


def test_an_image_is_copied_once_on_its_way_from_the_request_body_to_the_model() -> None:
    """A binary image is a view of the request body once decoded, and of that again in the
    frame written to the runner; the runner reads the frame into one buffer (the one copy,
    from one process to the other) and its model gets a view of that. Only joining several
    requests into one batch copies again, as it must."""
    runner = parse(yaml.safe_load(IMAGES.format(limit_ms=300))).runners["resnet"]
    array = image()
    body, headers = binary_body(array)
    header_length = int(headers["Inference-Header-Content-Length"])

    def send() -> tuple[np.ndarray, wire.Chunks]:
        call = protocol.decode_infer(body, header_length, runner)
        return call.inputs["images"], wire.encode(wire.Call(1, 0.3, 1, call.inputs))

    (decoded, chunks), sent_bytes = allocated_while(send)
    assert np.shares_memory(decoded, np.frombuffer(body, np.uint8))
    (data,) = [chunk for chunk in chunks if len(chunk) >= array.nbytes]
    assert np.shares_memory(np.frombuffer(data, np.uint8), decoded)
    assert sent_bytes < array.nbytes / 10

    frame = received(chunks)

    def run() -> tuple[np.ndarray, Any]:
        message = wire.decode(frame)
        assert isinstance(message, wire.Call)
        tensors = message.tensors
        joined = batching.join([tensors], 0)
        return tensors["images"], joined

    (arrived, joined), runner_bytes = allocated_while(run)
    assert np.shares_memory(arrived, np.frombuffer(frame, np.uint8))
    assert joined["images"] is arrived and runner_bytes < array.nbytes / 10
    np.testing.assert_array_equal(arrived, array)
    capture = Capture()
    Model(runner, capture, torch=True)(joined)
    (given,) = capture.given
    assert given.data_ptr() == arrived.ctypes.data  # torch.from_numpy: the same memory

    two = batching.join([{"images": arrived}, {"images": arrived}], 0)["images"]
    assert not np.shares_memory(two, arrived)  # a batch of several is one new buffer
