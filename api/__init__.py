"""The API tier: workers that speak the Open Inference Protocol v2 and forward to runners.

This folder owns the exchange both doors lead into (the v2 codec, errors, shedding, the
connections to runner processes), the processes that serve it (`worker`, `supervisor`,
`cli`) and the metrics table of the manual (`metric_table`); the doors are `http/` and
`grpc/`, `client/` is the Python client and `bench/` the load generator behind
`batchserve bench`.

A request passes through `worker` (uvicorn) and its HTTP `http.connection` (or the gRPC door,
`grpc.door`), then `service` (shedding by `overload`, decoding by `protocol` and `tensors`,
the answer's reserve by `reserve`), then `dispatch` (the process picked by `choice`, found by
`discovery`), which sends it to a runner over `batchserve.runner.core.wire`; the other HTTP
routes go through `http.app`.
"""
