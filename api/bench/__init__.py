"""`batchserve bench` and the open-loop load generator it drives: arrival schedules, sending
over HTTP/1.1, what a run measured, what the server's `/metrics` said, and the report."""
