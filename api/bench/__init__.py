"""`batchserve bench` and the open-loop load generator it drives: arrival schedules, sending
over HTTP/1.1 or gRPC (`grpcgen`), what a run measured, what the server's `/metrics` said, and
the report; with what the benchmark scripts share: starting and stopping the real server
(`server`) and reading its processes' CPU time from `/proc` (`cpu`)."""
