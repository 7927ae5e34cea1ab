"""The measurements behind docs/performance.md, docs/benchmarks.md and docs/dispatcher.md.

Each script is run as `python -m benchmarks.NAME` and prints the table its page shows: the
real server under open-loop load (`load`, `live_table`, `overload`, `soak`, `ragged`,
`two_hosts`, `request_path`), the dispatcher in simulation (`dispatcher_table`, `grid`,
`targets`, `at_arrival_bound`, with the scenarios in `scenarios/`), and other servers beside
batchserve (`peers/`). `benchmarks/README.md` says what each measures and what its columns
mean. Nothing in `runner/` or `api/` imports this folder.
"""
