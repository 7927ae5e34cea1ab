"""Ray Serve serving the bundled MLP: its HTTP proxy, one replica, ``@serve.batch`` at 64 rows.

Run inside ``.peers/ray/`` as ``python -m benchmarks.peers.rayserve_mlp --port PORT``: starts a
local Ray (no dashboard) as children of this process, deploys, and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import signal

from benchmarks.peers.peer import MAX_BATCH, WAIT_MS, Json, Peer


def _answer(reply: Json) -> list[float]:
    return reply["y"]  # type: ignore[index, no-any-return]


PEER = Peer(
    name="ray",
    packages=("ray[serve]",),
    path="/mlp",
    body=lambda row: {"x": row},
    answer=_answer,
    argv=lambda python, port: [python, "-m", "benchmarks.peers.rayserve_mlp", "--port", str(port)],
    batching=f"@serve.batch(max_batch_size={MAX_BATCH}, batch_wait_timeout_s={WAIT_MS / 1000:g}),"
    f" num_replicas=1, max_ongoing_requests={2 * MAX_BATCH}",
    env={"RAY_USAGE_STATS_ENABLED": "0"},
)


def main() -> None:
    import ray
    import torch
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from benchmarks.peers.peer import load_mlp

    # Ray's default max_ongoing_requests (5) would cap every batch at 5 rows and refuse the
    # rest; two full batches may wait at the replica, as Ray's own warning advises.
    @serve.deployment(num_replicas=1, max_ongoing_requests=2 * MAX_BATCH,
                      ray_actor_options={"num_cpus": 1})
    class MLP:
        def __init__(self) -> None:
            self.model = load_mlp()

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=WAIT_MS / 1000)
        async def infer(self, rows: list[list[float]]) -> list[list[float]]:
            with torch.inference_mode():
                return self.model(torch.tensor(rows)).tolist()  # type: ignore[operator, no-any-return]

        async def __call__(self, request: Request) -> JSONResponse:
            # A Response (not a dict) so the proxy sends Content-Length, not a chunked body.
            body = await request.json()
            return JSONResponse({"y": await self.infer(body["x"])})

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(MLP.bind(), route_prefix="/mlp")
    signal.signal(signal.SIGTERM, lambda *_: (serve.shutdown(), ray.shutdown(), exit(0)))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
